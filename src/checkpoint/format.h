#pragma once
// The checkpoint directory's format (docs/checkpoint.md), shared by save, load and describe:
// metadata entries, dtype names, checksummed file IO. Internal.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/comm/collectives.h"

namespace tessera::checkpoint::detail {

constexpr const char* kFormat = "tessera-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kMetadataFile = "metadata.json";
// Checksums cover blocks of this many bytes of a chunk, so a reader of a sub-range reads
// and verifies whole blocks, never a whole chunk it does not need.
constexpr int64_t kBlockBytes = int64_t{1} << 20;

// One rank's contiguous row-major bytes of a box [offsets, offsets + sizes) of a tensor.
struct Chunk {
  std::vector<int64_t> offsets, sizes;
  std::string file;  // relative to the checkpoint directory
  int64_t offset = 0, nbytes = 0;
  std::vector<uint32_t> crc32;  // one per kBlockBytes block
};

struct Entry {
  std::string name, kind;  // kind: tensor, int, double, bool, string
  std::string dtype;       // tensors
  std::vector<int64_t> shape;
  std::vector<Chunk> chunks;
  Value value;  // scalars
};

std::string dtype_name(c10::ScalarType t);
c10::ScalarType dtype_from_name(const std::string& name);  // throws naming it
std::string kind_of(const Value& v);
std::string data_file_name(int rank);

nlohmann::json chunk_to_json(const Chunk& c);
Chunk chunk_from_json(const nlohmann::json& j);

// Parses <dir>/metadata.json; throws a message naming what is wrong.
std::vector<Entry> read_metadata(const std::string& dir);

// A group over every rank of the calling thread's world, made once per world.
comm::Group world_group();

uint32_t crc32_of(const void* data, size_t bytes);

// POSIX file helpers that throw naming the path and errno's text.
int open_for_write(const std::string& path);
int open_for_read(const std::string& path);
void write_all(int fd, const void* data, int64_t bytes, const std::string& path);
void read_at(int fd, void* data, int64_t bytes, int64_t offset, const std::string& path);
void sync_and_close(int fd, const std::string& path);
void sync_directory(const std::string& dir);

}  // namespace tessera::checkpoint::detail
