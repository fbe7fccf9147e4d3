#pragma once
#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"
