#include "format.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>

#include <c10/util/Exception.h>

#include "tessera/runtime/world.h"

namespace tessera::checkpoint::detail {

namespace {

const std::vector<std::pair<c10::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<c10::ScalarType, const char*>> names = {
      {c10::kFloat, "float32"},
      {c10::kDouble, "float64"},
      {c10::kHalf, "float16"},
      {c10::kBFloat16, "bfloat16"},
      {c10::kLong, "int64"},
      {c10::kInt, "int32"},
      {c10::kShort, "int16"},
      {c10::kChar, "int8"},
      {c10::kByte, "uint8"},
      {c10::kBool, "bool"},
      {c10::kComplexFloat, "complex64"},
      {c10::kComplexDouble, "complex128"}};
  return names;
}

[[noreturn]] void io_error(const char* what, const std::string& path) {
  TORCH_CHECK(false, "tessera: checkpoint: cannot ", what, " ", path, ": ", std::strerror(errno));
}

}  // namespace

std::string dtype_name(c10::ScalarType t) {
  for (const auto& [type, name] : dtype_names())
    if (type == t) return name;
  TORCH_CHECK(false, "tessera: checkpoint: tensors of dtype ", t, " cannot be saved");
}

c10::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& [type, n] : dtype_names())
    if (name == n) return type;
  TORCH_CHECK(false, "tessera: checkpoint: unknown dtype \"", name, "\" in the metadata");
}

std::string kind_of(const Value& v) {
  switch (v.index()) {
    case 0: return "tensor";
    case 1: return "int";
    case 2: return "double";
    case 3: return "bool";
    default: return "string";
  }
}

std::string data_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "data-%05d.bin", rank);
  return name;
}

nlohmann::json chunk_to_json(const Chunk& c) {
  return {{"offsets", c.offsets}, {"sizes", c.sizes},   {"file", c.file},
          {"offset", c.offset},   {"nbytes", c.nbytes}, {"crc32", c.crc32}};
}

Chunk chunk_from_json(const nlohmann::json& j) {
  Chunk c;
  c.offsets = j.at("offsets").get<std::vector<int64_t>>();
  c.sizes = j.at("sizes").get<std::vector<int64_t>>();
  c.file = j.at("file").get<std::string>();
  c.offset = j.at("offset").get<int64_t>();
  c.nbytes = j.at("nbytes").get<int64_t>();
  c.crc32 = j.at("crc32").get<std::vector<uint32_t>>();
  return c;
}

std::vector<Entry> read_metadata(const std::string& dir) {
  const std::string path = dir + "/" + kMetadataFile;
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "tessera: checkpoint: no checkpoint at ", dir, " (", path,
              " is missing: the directory does not exist, is not a checkpoint, or its save ",
              "never completed)");
  nlohmann::json meta;
  try {
    in >> meta;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "tessera: checkpoint: ", path, " is not valid JSON (", e.what(), ")");
  }
  std::vector<Entry> entries;
  try {
    TORCH_CHECK(meta.at("format").get<std::string>() == kFormat && meta.at("version") == kVersion,
                "not a version ", kVersion, " ", kFormat);
    for (const auto& j : meta.at("entries")) {
      Entry e;
      e.name = j.at("name").get<std::string>();
      e.kind = j.at("kind").get<std::string>();
      if (e.kind == "tensor") {
        e.dtype = j.at("dtype").get<std::string>();
        e.shape = j.at("shape").get<std::vector<int64_t>>();
        for (const auto& c : j.at("chunks")) e.chunks.push_back(chunk_from_json(c));
      } else if (e.kind == "int") {
        e.value = j.at("value").get<int64_t>();
      } else if (e.kind == "double") {
        e.value = j.at("value").get<double>();
      } else if (e.kind == "bool") {
        e.value = j.at("value").get<bool>();
      } else {
        e.value = j.at("value").get<std::string>();
      }
      entries.push_back(std::move(e));
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "tessera: checkpoint: ", path, ": ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "tessera: checkpoint: ", path, " is malformed (", e.what(), ")");
  }
  return entries;
}

comm::Group world_group() {
  auto world = current_world();
  struct Cached {
    std::weak_ptr<World> world;
    comm::Group group;
  };
  // Never destroyed: a process group torn down by exit-time destructors (after CUDA's own
  // teardown) crashed the GPU tier's processes at exit. Groups of worlds that ended are
  // dropped here instead, on the next call, while the process is whole.
  static std::mutex& mu = *new std::mutex;
  static auto& groups = *new std::map<const World*, Cached>;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = groups.begin(); it != groups.end();)
      it = it->second.world.expired() ? groups.erase(it) : std::next(it);
    auto it = groups.find(world.get());
    if (it != groups.end()) return it->second.group;
  }
  // Made outside the lock: it waits for the other ranks, which may be threads of this
  // process (run_ranks) on their way here.
  std::vector<int> ranks(world->size());
  for (int r = 0; r < world->size(); ++r) ranks[r] = r;
  auto group = world->new_group(ranks, "checkpoint", c10::DeviceType::CPU, "gloo");
  std::lock_guard<std::mutex> lock(mu);
  groups[world.get()] = {world, group};
  return group;
}

uint32_t crc32_of(const void* data, size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    const uInt n = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    bytes -= n;
  }
  return static_cast<uint32_t>(crc);
}

int open_for_write(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error("create", path);
  return fd;
}

int open_for_read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) io_error("open", path);
  return fd;
}

void write_all(int fd, const void* data, int64_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, 1 << 30)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) io_error("write", path);
    p += n;
    bytes -= n;
  }
}

void read_at(int fd, void* data, int64_t bytes, int64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n =
        ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, 1 << 30)), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_error("read", path);
    TORCH_CHECK(n > 0, "tessera: checkpoint: ", path, " is shorter than its metadata says (",
                "truncated?)");
    p += n;
    bytes -= n;
    offset += n;
  }
}

void sync_and_close(int fd, const std::string& path) {
  if (::fsync(fd) != 0) {
    ::close(fd);
    io_error("fsync", path);
  }
  if (::close(fd) != 0) io_error("close", path);
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_error("open directory", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) io_error("fsync directory", dir);
}

}  // namespace tessera::checkpoint::detail
