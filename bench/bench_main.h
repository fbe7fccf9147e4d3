#pragma once
// main() of a benchmark that counts CPU memory: its allocator is installed before any tensor
// exists (so every CPU buffer is counted), and errors are printed with the program's name.
#include <cstdio>
#include <exception>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

template <class CountingAllocator>
int counting_bench_main(const char* name, int (*run)(int, char**), int argc, char** argv) {
  static CountingAllocator counting(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
  }
  return 1;
}
