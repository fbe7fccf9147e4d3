// save / async_save / load / describe. NOTE: [Checkpoint protocol]
//
// Save (collective over the world):
//  1. Every rank hashes its state's names, kinds, dtypes and shapes; all-gathered, they must
//     agree (a mismatch is an error on every rank, before any byte is written). Rank 0's
//     nonce names the temporary directory <path>.tmp-<nonce>, which rank 0 creates.
//  2. Partial tensors are reduced. A rank owns the box it holds when its coordinate is 0 on
//     every mesh dim that does not shard the tensor (one writer per replica set); plain
//     tensors are owned by rank 0. Each rank writes its boxes back to back into its own
//     data-<rank>.bin, checksumming every 1 MiB block, and fsyncs it.
//  3. The chunk lists are all-gathered; rank 0 writes metadata.json last, fsyncs it and the
//     directory, and publishes: rename(tmp, path), or for an existing path an atomic
//     exchange (renameat2 RENAME_EXCHANGE) followed by removing the old one. Until then the
//     checkpoint is invisible; a crash at any point leaves at most a .tmp- directory and the
//     previous checkpoint untouched.
// Load: every rank parses the metadata, checks every requested entry (presence, kind,
// dtype, shape) before reading, then for each box it holds reads only the byte span of
// each saved chunk that overlaps it, in whole checksum blocks, and verifies them. Any
// rank's failure is raised on every rank (comm::check_everywhere).
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include "format.h"
#include "tessera/comm/agree.h"
#include "tessera/runtime/world.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace fs = std::filesystem;

namespace tessera::checkpoint {

using detail::Chunk;
using detail::Entry;

namespace {

std::string signature(const StateDict& state) {
  std::string sig;
  for (const auto& [name, value] : state.items()) {
    sig += name + '\x1f' + detail::kind_of(value);
    if (const auto* t = std::get_if<at::Tensor>(&value)) {
      TORCH_CHECK(t->defined(), "tessera: checkpoint: entry \"", name, "\" is an undefined tensor");
      sig += '\x1f' + detail::dtype_name(t->scalar_type()) + '\x1f' + shape_str(t->sizes().vec());
    }
    sig += '\x1e';
  }
  return sig;
}

// One box this rank writes.
struct Piece {
  std::string name;
  at::Tensor data;  // CPU, contiguous
  std::vector<int64_t> offsets;
};

}  // namespace

// Everything between the collective start and the collective end of a save.
struct AsyncSave::Impl {
  std::string path, tmp;
  SaveOptions options;
  comm::Group group;
  int rank = 0;
  std::vector<Entry> entries;  // in state order; tensors without chunks yet
  std::vector<Piece> pieces;
  std::vector<Chunk> chunks;  // this rank's, as written (Chunk::file set)
  std::vector<std::string> chunk_names;
  std::string error;  // this rank's write failure
  std::thread writer;
  bool finished = true;
};

namespace {

std::unique_ptr<AsyncSave::Impl> prepare(const StateDict& state, const std::string& path,
                                         const SaveOptions& options, bool copy) {
  auto s = std::make_unique<AsyncSave::Impl>();
  s->path = path;
  s->options = options;
  s->group = detail::world_group();
  s->rank = comm::group_rank(s->group);
  const std::string where = "tessera: checkpoint::save(" + path + ")";
  const auto sig_hash = static_cast<int64_t>(std::hash<std::string>()(signature(state)));
  const auto nonce = static_cast<int64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count() ^ (int64_t{::getpid()} << 40));
  const auto all = comm::all_gather_ints(s->group, {sig_hash, nonce});
  bool agree = true;
  for (const auto& v : all) agree = agree && v[0] == all[0][0];
  comm::check_everywhere(s->group, agree,
                         where + ": the ranks passed different states (names, kinds, dtypes or " +
                             "global shapes differ); every rank must build the same StateDict");
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(all[0][1]));
  s->tmp = path + ".tmp-" + hex;
  std::string err;
  if (s->rank == 0) {
    try {
      if (fs::exists(path) && !options.overwrite)
        err = where + ": " + path + " already exists; save to a new path or set " +
              "SaveOptions::overwrite (the old checkpoint stays intact until the new one is " +
              "complete)";
      else
        fs::create_directories(s->tmp);
    } catch (const std::exception& e) {
      err = where + ": cannot create " + s->tmp + ": " + e.what();
    }
  }
  comm::check_everywhere(s->group, err.empty(), err);

  at::NoGradGuard no_grad;
  for (const auto& [name, value] : state.items()) {
    Entry e;
    e.name = name;
    e.kind = detail::kind_of(value);
    const auto* t = std::get_if<at::Tensor>(&value);
    if (!t) {
      e.value = value;
      s->entries.push_back(std::move(e));
      continue;
    }
    e.dtype = detail::dtype_name(t->scalar_type());
    e.shape = t->sizes().vec();
    s->entries.push_back(std::move(e));
    at::Tensor local;
    std::vector<int64_t> offsets(t->dim(), 0);
    bool owner = false;
    if (is_dtensor(*t)) {
      at::Tensor x = t->detach();
      const DTensorSpec& sp = spec(x);
      if (!sp.mesh().contains_this_rank()) continue;
      if (sp.has_partial() || sp.has_head_tail()) {  // collective over the tensor's mesh
        // Pieces are boxes of the global tensor: sums reduced, head-tail rows in order.
        Placements p = sp.placements();
        for (auto& pl : p) pl = pl.is_partial() ? Replicate() : pl.natural();
        x = redistribute(x, p);
      }
      const DTensorSpec& xs = spec(x);
      owner = true;
      for (int64_t m = 0; m < xs.mesh().ndim(); ++m)
        if (!xs.placement(m).is_shard() && xs.mesh().local_rank(m) != 0) owner = false;
      local = dtensor_impl(x)->local();
      offsets = xs.local_offsets();
    } else {
      owner = s->rank == 0;
      local = t->detach();
    }
    if (!owner || local.numel() == 0) continue;
    at::Tensor data = local.to(at::kCPU, /*non_blocking=*/false, /*copy=*/copy).contiguous();
    s->pieces.push_back({name, std::move(data), std::move(offsets)});
  }
  return s;
}

// Local: this rank's data file. Errors are kept for finish() to raise everywhere.
void write_pieces(AsyncSave::Impl& s) {
  const std::string file = detail::data_file_name(s.rank);
  const std::string full = s.tmp + "/" + file;
  try {
    const int fd = detail::open_for_write(full);
    int64_t pos = 0;
    try {
      for (const auto& piece : s.pieces) {
        Chunk c;
        c.offsets = piece.offsets;
        c.sizes = piece.data.sizes().vec();
        c.file = file;
        c.offset = pos;
        c.nbytes = static_cast<int64_t>(piece.data.nbytes());
        const char* bytes = static_cast<const char*>(piece.data.data_ptr());
        for (int64_t b = 0; b < c.nbytes; b += detail::kBlockBytes)
          c.crc32.push_back(
              detail::crc32_of(bytes + b, std::min(detail::kBlockBytes, c.nbytes - b)));
        detail::write_all(fd, bytes, c.nbytes, full);
        pos += c.nbytes;
        s.chunks.push_back(std::move(c));
        s.chunk_names.push_back(piece.name);
        if (s.options.on_progress) s.options.on_progress(pos);
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    detail::sync_and_close(fd, full);
  } catch (const c10::Error& e) {
    s.error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    s.error = std::string("tessera: checkpoint: writing ") + full + ": " + e.what();
  }
  s.pieces.clear();  // the host copies go as soon as they are on disk
}

// Moves `tmp` to `path` atomically; an existing `path` is exchanged, then removed.
void publish(const std::string& tmp, const std::string& path) {
  const fs::path parent = fs::absolute(path).parent_path();
  if (!fs::exists(path)) {
    fs::rename(tmp, path);
  } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp);  // now the old checkpoint
  } else {
    // A filesystem without atomic exchange: the old one is moved aside first.
    const std::string old = tmp + ".old";
    fs::rename(path, old);
    fs::rename(tmp, path);
    fs::remove_all(old);
  }
  detail::sync_directory(parent.string());
}

// Collective: raises any rank's write error, gathers the chunk lists, writes the metadata
// (rank 0) and publishes the directory.
void finish(AsyncSave::Impl& s) {
  const std::string where = "tessera: checkpoint::save(" + s.path + ")";
  comm::check_everywhere(s.group, s.error.empty(), s.error);
  nlohmann::json mine = nlohmann::json::array();
  for (size_t i = 0; i < s.chunks.size(); ++i)
    mine.push_back({{"name", s.chunk_names[i]}, {"chunk", detail::chunk_to_json(s.chunks[i])}});
  const std::string text = mine.dump();
  const int64_t n = comm::group_size(s.group);
  const auto lengths = comm::all_gather_ints(s.group, {static_cast<int64_t>(text.size())});
  std::vector<int64_t> sizes;
  for (const auto& l : lengths) sizes.push_back(l[0]);
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  at::Tensor all = n == 1 ? bytes : comm::all_gather(s.group, bytes, 0, sizes);
  std::string err;
  if (s.rank == 0) {
    try {
      std::map<std::string, std::vector<Chunk>> by_name;
      int64_t pos = 0;
      for (int64_t r = 0; r < n; ++r) {
        const std::string part(static_cast<const char*>(all.data_ptr()) + pos, sizes[r]);
        pos += sizes[r];
        for (const auto& j : nlohmann::json::parse(part))
          by_name[j.at("name").get<std::string>()].push_back(
              detail::chunk_from_json(j.at("chunk")));
      }
      nlohmann::json entries = nlohmann::json::array();
      for (const auto& e : s.entries) {
        nlohmann::json j = {{"name", e.name}, {"kind", e.kind}};
        if (e.kind == "tensor") {
          j["dtype"] = e.dtype;
          j["shape"] = e.shape;
          nlohmann::json chunks = nlohmann::json::array();
          for (const auto& c : by_name[e.name]) chunks.push_back(detail::chunk_to_json(c));
          j["chunks"] = std::move(chunks);
        } else {
          std::visit(
              [&](const auto& v) {
                if constexpr (!std::is_same_v<std::decay_t<decltype(v)>, at::Tensor>)
                  j["value"] = v;
              },
              e.value);
        }
        entries.push_back(std::move(j));
      }
      const nlohmann::json meta = {{"format", detail::kFormat},
                                   {"version", detail::kVersion},
                                   {"world_size", n},
                                   {"block_bytes", detail::kBlockBytes},
                                   {"entries", std::move(entries)}};
      const std::string file = s.tmp + "/" + detail::kMetadataFile;
      const std::string out = meta.dump(1);
      const int fd = detail::open_for_write(file);
      detail::write_all(fd, out.data(), static_cast<int64_t>(out.size()), file);
      detail::sync_and_close(fd, file);
      detail::sync_directory(s.tmp);
      publish(s.tmp, s.path);
    } catch (const c10::Error& e) {
      err = e.what_without_backtrace();
    } catch (const std::exception& e) {
      err = where + ": " + e.what();
    }
  }
  comm::check_everywhere(s.group, err.empty(), err);
}

}  // namespace

void save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  auto s = prepare(state, path, options, /*copy=*/false);
  write_pieces(*s);
  finish(*s);
}

AsyncSave::AsyncSave() = default;
AsyncSave::AsyncSave(AsyncSave&&) noexcept = default;
AsyncSave& AsyncSave::operator=(AsyncSave&& o) noexcept {
  if (this != &o) {
    if (impl_ && impl_->writer.joinable()) impl_->writer.join();
    impl_ = std::move(o.impl_);
  }
  return *this;
}
AsyncSave::~AsyncSave() {
  // Never leave the writer running on freed state; an unfinished save stays invisible.
  if (impl_ && impl_->writer.joinable()) impl_->writer.join();
}

void AsyncSave::wait() {
  TORCH_CHECK(impl_ && !impl_->finished, "tessera: AsyncSave::wait: nothing to wait for");
  if (impl_->writer.joinable()) impl_->writer.join();
  impl_->finished = true;
  finish(*impl_);
}

AsyncSave async_save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  AsyncSave handle;
  handle.impl_ = prepare(state, path, options, /*copy=*/true);
  handle.impl_->finished = false;
  AsyncSave::Impl* s = handle.impl_.get();
  s->writer = std::thread([s] { write_pieces(*s); });
  return handle;
}

namespace {

// Reads the part of chunk `c` inside the box [lo, hi) (which overlaps it) as a tensor of the
// box's shape: the byte span from its first to its last element, in whole checksum blocks,
// each verified.
at::Tensor read_overlap(int fd, const std::string& file, const Chunk& c, c10::ScalarType dtype,
                        const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                        const std::string& name) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const auto strides = c10::contiguous_strides(c.sizes);
  int64_t first = 0, last = 0;
  std::vector<int64_t> shape;
  for (size_t d = 0; d < lo.size(); ++d) {
    first += (lo[d] - c.offsets[d]) * strides[d];
    last += (hi[d] - 1 - c.offsets[d]) * strides[d];
    shape.push_back(hi[d] - lo[d]);
  }
  const int64_t begin = first * es, end = (last + 1) * es;
  const int64_t b0 = begin / detail::kBlockBytes;
  const int64_t b1 = (end + detail::kBlockBytes - 1) / detail::kBlockBytes;
  TORCH_CHECK(static_cast<int64_t>(c.crc32.size()) >= b1, "tessera: checkpoint: entry \"", name,
              "\": the metadata lists too few checksums for ", file);
  const int64_t start = b0 * detail::kBlockBytes;
  const int64_t stop = std::min(b1 * detail::kBlockBytes, c.nbytes);
  at::Tensor buf = at::empty({stop - start}, at::kByte);
  detail::read_at(fd, buf.data_ptr(), stop - start, c.offset + start, file);
  const char* p = static_cast<const char*>(buf.data_ptr());
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t off = b * detail::kBlockBytes - start;
    const int64_t len = std::min(detail::kBlockBytes, c.nbytes - b * detail::kBlockBytes);
    TORCH_CHECK(detail::crc32_of(p + off, static_cast<size_t>(len)) == c.crc32[b],
                "tessera: checkpoint: entry \"", name, "\": checksum mismatch in ", file,
                " at byte ", c.offset + b * detail::kBlockBytes,
                " (the file is corrupt or was changed after the save)");
  }
  return buf.narrow(0, begin - start, end - begin).view(dtype).as_strided(shape, strides);
}

}  // namespace

void load(StateDict& state, const std::string& path) {
  const auto group = detail::world_group();
  const std::string where = "tessera: checkpoint::load(" + path + ")";
  std::vector<Entry> entries;
  std::string err;
  try {
    entries = detail::read_metadata(path);
  } catch (const c10::Error& e) {
    err = e.what_without_backtrace();
  }
  comm::check_everywhere(group, err.empty(), err);
  std::map<std::string, const Entry*> by_name;
  for (const auto& e : entries) by_name[e.name] = &e;

  // Every problem a rank can see from the metadata and its own state, before reading.
  for (const auto& [name, value] : state.items()) {
    auto it = by_name.find(name);
    const std::string kind = detail::kind_of(value);
    if (it == by_name.end()) {
      err += "\n  \"" + name + "\" is not in the checkpoint";
      continue;
    }
    const Entry& e = *it->second;
    if (e.kind != kind) {
      err += "\n  \"" + name + "\": saved as " + e.kind + ", loading into " + kind;
      continue;
    }
    if (kind != "tensor") continue;
    const at::Tensor& t = std::get<at::Tensor>(value);
    if (!t.defined()) {
      err += "\n  \"" + name + "\": the tensor to load into is undefined";
      continue;
    }
    const std::string dtype = detail::dtype_name(t.scalar_type());
    if (e.dtype != dtype || e.shape != t.sizes().vec())
      err += "\n  \"" + name + "\": saved " + e.dtype + " " + shape_str(e.shape) +
             ", loading into " + dtype + " " + shape_str(t.sizes().vec());
    else if (is_dtensor(t) && spec(t).has_partial())
      err += "\n  \"" + name + "\": cannot load into a Partial tensor (" + spec(t).str() + ")";
    else if (is_dtensor(t) && spec(t).has_head_tail())
      err += "\n  \"" + name + "\": cannot load into a head-tail tensor (" + spec(t).str() +
             "); load into its natural order (" + to_string(spec(t).natural_spec().placements()) +
             ") and redistribute after";
  }
  comm::check_everywhere(group, err.empty(), err.empty() ? err : where + ":" + err);

  std::map<std::string, int> fds;
  try {
    at::NoGradGuard no_grad;
    for (auto& [name, value] : state.items()) {
      const Entry& e = *by_name.at(name);
      if (e.kind != "tensor") {
        value = e.value;
        continue;
      }
      const at::Tensor& t = std::get<at::Tensor>(value);
      at::Tensor local = t;
      std::vector<int64_t> box_lo(t.dim(), 0), box_size = t.sizes().vec();
      if (is_dtensor(t)) {
        const DTensorSpec& sp = spec(t);
        if (!sp.mesh().contains_this_rank()) continue;
        local = dtensor_impl(t)->local();
        box_lo = sp.local_offsets();
        box_size = sp.local_sizes();
      }
      const c10::ScalarType dtype = detail::dtype_from_name(e.dtype);
      for (const auto& c : e.chunks) {
        std::vector<int64_t> lo, hi;
        bool overlap = true;
        for (int64_t d = 0; d < t.dim(); ++d) {
          lo.push_back(std::max(box_lo[d], c.offsets[d]));
          hi.push_back(std::min(box_lo[d] + box_size[d], c.offsets[d] + c.sizes[d]));
          overlap = overlap && hi[d] > lo[d];
        }
        if (!overlap) continue;
        const std::string file = path + "/" + c.file;
        auto fd = fds.find(file);
        if (fd == fds.end()) fd = fds.emplace(file, detail::open_for_read(file)).first;
        at::Tensor part = read_overlap(fd->second, file, c, dtype, lo, hi, name);
        at::Tensor dst = local;
        for (int64_t d = 0; d < t.dim(); ++d) dst = dst.narrow(d, lo[d] - box_lo[d], hi[d] - lo[d]);
        dst.copy_(part);
      }
      // The distributed tensor's own version moves too: fully_shard regathers a parameter
      // whose value changed under a gathered copy.
      if (is_dtensor(t)) t.unsafeGetTensorImpl()->bump_version();
    }
  } catch (const c10::Error& e) {
    err = e.what_without_backtrace();
  } catch (const std::exception& e) {
    err = where + ": " + e.what();
  }
  for (const auto& [file, fd] : fds) ::close(fd);
  comm::check_everywhere(group, err.empty(), err);
}

std::vector<EntryInfo> describe(const std::string& path) {
  std::vector<EntryInfo> out;
  for (const auto& e : detail::read_metadata(path))
    out.push_back({e.name, e.kind, e.dtype, e.shape});
  return out;
}

}  // namespace tessera::checkpoint
