#pragma once
// The examples' text progress bar: "[#########...........]" for step of steps.
#include <cstdint>
#include <string>

inline std::string progress_bar(int step, int steps, int width = 20) {
  const int filled = static_cast<int>(static_cast<int64_t>(step) * width / steps);
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
}
