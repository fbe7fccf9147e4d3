#pragma once
// Tessera: distributed tensors for LibTorch. One include for the whole public API.
#include "tessera/compat.h"
#include "tessera/runtime/world.h"
#include "tessera/mesh/device_mesh.h"
#include "tessera/placement/placement.h"
#include "tessera/placement/spec.h"
#include "tessera/comm/accounting.h"
#include "tessera/comm/collectives.h"
#include "tessera/comm/halo.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tessera/tensor/random.h"
#include "tessera/tensor/registration.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/rule.h"
#include "tessera/ops/attention.h"
#include "tessera/tools/comm_debug_mode.h"
#include "tessera/parallel/module.h"
#include "tessera/parallel/tensor_parallel.h"
#include "tessera/parallel/loss_parallel.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/parallel/fully_shard.h"
#include "tessera/checkpoint/checkpoint.h"
// Neighbourhood attention has its own header, "tessera/nn/neighborhood_attention.h": its
// tessera::nn namespace would make `nn::` ambiguous in code that uses both `using namespace
// tessera` and torch::nn.
