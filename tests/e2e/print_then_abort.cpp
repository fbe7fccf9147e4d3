// Rank 1 prints a line (std::cout and printf, no flush) and aborts: under tessera-run the
// line must reach the launcher's output (NOTE: [Rank output survives a crash]).
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "tessera/tessera.h"

int main() {
  tessera::init_process_group();
  if (tessera::get_rank() == 1) {
    std::cout << "cout line before the crash\n";
    std::printf("printf line before the crash\n");
    std::abort();
  }
  return 0;
}
