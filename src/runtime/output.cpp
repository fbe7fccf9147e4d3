// Line-buffered stdout under a launcher (NOTE: [Rank output survives a crash]).
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tessera {
namespace {

// NOTE: [Rank output survives a crash]
// tessera-run reads each rank's stdout through a pipe, and the C library buffers a pipe
// fully: a rank that aborts loses everything it printed since the last 4 KiB, often the very
// lines that explain the crash. The launcher sets TESSERA_LINE_BUFFERED=1 and the library,
// when it is loaded (before main), makes stdout line-buffered, as stdbuf -oL would; std::cout
// writes through stdio (sync_with_stdio is on by default), so it follows. Cost: one write per
// line instead of one per 4 KiB.
[[maybe_unused]] const bool g_line_buffered = [] {
  const char* v = std::getenv("TESSERA_LINE_BUFFERED");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return false;
  return std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ) == 0;
}();

}  // namespace

}  // namespace tessera
