#include "tp_boundary.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <string_view>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tensor/fallback_hooks.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::tp::detail {

// ---- meshes --------------------------------------------------------------------------------

TpMesh TpMesh::of(const DeviceMesh& tp_mesh, const std::string& where) {
  TORCH_CHECK(tp_mesh.defined(), "tessera: ", where, ": no mesh given");
  TORCH_CHECK(tp_mesh.ndim() == 1, "tessera: ", where,
              ": tensor parallelism takes a 1-D mesh; got ", tp_mesh.str(),
              ". Pass a slice such as mesh[\"tp\"]");
  TpMesh m;
  m.root = tp_mesh.root();
  m.dim = tp_mesh.dims_in_root()[0];
  return m;
}

Placements TpMesh::with(Placements base, Placement p) const {
  if (base.empty()) base.assign(static_cast<size_t>(root.ndim()), Replicate());
  base[static_cast<size_t>(dim)] = p;
  return base;
}

// ---- module and parameter tables -----------------------------------------------------------

namespace {

// Keyed by address, with a weak handle that tells a live entry from a reused address.
struct ModuleEntry {
  std::weak_ptr<const torch::nn::Module> alive;
  bool by_address = false;  // not held by a shared_ptr (a module on the stack)
  BoundaryPtr boundary;
  std::shared_ptr<const ModuleInput> input;
  std::vector<Convert> outputs;
};
struct ParamEntry {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> alive;
  BoundaryPtr boundary;
  bool live() const { return alive && !alive->expired(); }
};

struct Tables {
  std::shared_mutex mu;
  std::unordered_map<const torch::nn::Module*, ModuleEntry> modules;
  std::unordered_map<const c10::TensorImpl*, ParamEntry> params;
  std::unordered_map<const c10::StorageImpl*, ParamEntry> storages;  // of their local shards
  std::atomic<int64_t> guarded{0};  // tagged parameters whose boundary forbids plain operands
};

Tables& tables() {
  static Tables t;
  return t;
}

std::weak_ptr<const torch::nn::Module> weak_of(const torch::nn::Module& m) {
  try {
    return m.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return {};  // a module on the stack: identity by address only
  }
}

// A module known only by its address whose parameter style tagged parameters it no longer
// holds is another module at a reused address (the first one went out of scope).
bool lost_its_parameters(const Tables& t, const ModuleEntry& e, const torch::nn::Module& m) {
  if (!e.by_address || !e.boundary || !e.boundary->has_param_style) return false;
  const auto own = m.parameters(/*recurse=*/false);
  if (own.empty()) return false;
  for (const auto& p : own) {
    auto it = t.params.find(p.unsafeGetTensorImpl());
    if (it != t.params.end() && it->second.live() && it->second.boundary == e.boundary)
      return false;
  }
  return true;
}

ModuleEntry& entry_locked(Tables& t, const torch::nn::Module& m) {
  auto it = t.modules.find(&m);
  if (it != t.modules.end()) {
    // A module once held by a shared_ptr whose pointer expired is dead, whatever now sits at
    // its address (held by a shared_ptr or not).
    const bool stale = (!it->second.by_address && it->second.alive.expired()) ||
                       lost_its_parameters(t, it->second, m);
    if (!stale) return it->second;
    t.modules.erase(it);
  }
  auto& e = t.modules[&m];
  e.alive = weak_of(m);
  e.by_address = e.alive.expired();
  return e;
}

}  // namespace

BoundaryPtr boundary_for(torch::nn::Module& module) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  auto& e = entry_locked(t, module);
  if (!e.boundary) e.boundary = std::make_shared<Boundary>();
  return e.boundary;
}

BoundaryPtr find_boundary(const torch::nn::Module& module) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  auto it = t.modules.find(&module);
  return it == t.modules.end() ? nullptr : entry_locked(t, module).boundary;
}

void set_module_input(torch::nn::Module& module, std::shared_ptr<const ModuleInput> input) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  entry_locked(t, module).input = std::move(input);
}

std::shared_ptr<const ModuleInput> module_input(const torch::nn::Module& module) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  auto it = t.modules.find(&module);
  return it == t.modules.end() ? nullptr : entry_locked(t, module).input;
}

void add_module_output(torch::nn::Module& module, Convert output) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  entry_locked(t, module).outputs.push_back(std::move(output));
}

std::vector<Convert> module_outputs(const torch::nn::Module& module) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  auto it = t.modules.find(&module);
  return it == t.modules.end() ? std::vector<Convert>{} : entry_locked(t, module).outputs;
}

namespace {
void check_plain_operands(const c10::OperatorHandle& op,
                          c10::ArrayRef<const c10::TensorImpl*> distributed,
                          c10::ArrayRef<at::Tensor> plain);
}

void tag_parameter(const at::Tensor& parameter, BoundaryPtr boundary) {
  auto& t = tables();
  std::unique_lock<std::shared_mutex> lock(t.mu);
  auto* impl = parameter.unsafeGetTensorImpl();
  auto& e = t.params[impl];
  const bool was_guarded = e.boundary && e.live() && e.boundary->plain_forbidden;
  e.alive.emplace(parameter.getIntrusivePtr());
  e.boundary = std::move(boundary);
  if (e.boundary->plain_forbidden && !was_guarded && t.guarded.fetch_add(1) == 0)
    set_plain_operand_check(&check_plain_operands);
  if (is_dtensor(parameter)) {
    const at::Tensor& local = dtensor_impl(parameter)->local();
    if (local.has_storage()) {
      auto& se = t.storages[local.storage().unsafeGetStorageImpl()];
      se.alive.emplace(parameter.getIntrusivePtr());
      se.boundary = e.boundary;
    }
  }
}

BoundaryPtr boundary_of_view(const at::Tensor& view) {
  auto& t = tables();
  if (!view.defined() || !is_dtensor(view)) return nullptr;
  std::shared_lock<std::shared_mutex> lock(t.mu);
  if (t.storages.empty()) return nullptr;
  const at::Tensor& local = dtensor_impl(view)->local();
  if (!local.has_storage()) return nullptr;
  auto it = t.storages.find(local.storage().unsafeGetStorageImpl());
  if (it == t.storages.end() || !it->second.live()) return nullptr;
  return it->second.boundary;
}

BoundaryPtr boundary_of(const at::Tensor& parameter) {
  auto& t = tables();
  if (!parameter.defined()) return nullptr;
  std::shared_lock<std::shared_mutex> lock(t.mu);
  if (t.params.empty()) return nullptr;
  auto it = t.params.find(parameter.unsafeGetTensorImpl());
  if (it == t.params.end() || !it->second.live()) return nullptr;
  return it->second.boundary;
}

namespace {

// NOTE: [Plain operands at modules Tessera cannot intercept]
// SequenceParallel on a module whose forward is not one ATen op (a hand-written RMSNorm)
// cannot read a plain input as a sequence shard: the module's first ops run before any
// parameter is touched. A distributed input is exact; a plain one would be taken for a
// replicated value, silently wrong, so it is an error where it meets the parameter. An op
// that also reads a distributed activation (a tensor that is not the module's own) is
// inside the module's data flow: its plain operands are state the module made itself (an
// RNN's zero initial state), global values, and pass.
void check_plain_operands(const c10::OperatorHandle& op,
                          c10::ArrayRef<const c10::TensorImpl*> distributed,
                          c10::ArrayRef<at::Tensor> plain) {
  bool floating = false;
  for (const auto& p : plain) floating = floating || at::isFloatingType(p.scalar_type());
  if (!floating) return;
  auto& t = tables();
  std::shared_lock<std::shared_mutex> lock(t.mu);
  for (const auto* impl : distributed) {
    auto it = t.params.find(impl);
    if (it == t.params.end() || !it->second.live()) return;  // an activation
  }
  for (const auto* impl : distributed) {
    auto it = t.params.find(impl);
    const auto& b = *it->second.boundary;
    if (!b.plain_forbidden) continue;
    TORCH_CHECK(false, "tessera: ", op.schema().name(), ": a plain (local) tensor of shape ",
                shape_str(plain[0].sizes().vec()), " meets the parameters of '", b.fqn, "' (",
                b.style,
                "). Tessera cannot see that module's input (its forward is not one ATen "
                "op), so it cannot read a plain tensor as sequence shards. Give it a distributed "
                "input: set use_local_output(false) on the style of the module before it, or "
                "call tessera::from_local(x, mesh, {Shard(",
                b.sequence_dim, ")}) yourself");
  }
}

// ---- per-thread state: module entries and the conversion memo ------------------------------

// NOTE: [Recognising a module's input]
// A PrepareModuleInput on a composite module (an attention block) is carried out at the
// tagged ops inside it. The module is entered when one of its tagged ops runs after a tagged
// op outside it ran, or when a tagged op runs a second time (the module was called again).
// The tensor that first op receives is the module's input; later ops that receive the very
// same tensor (wq, wk, wv) get the one converted tensor, so the conversion's collective
// happens once and autograd sums the gradients before its backward.
struct Entered {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> input;
  int64_t version = 0;
  at::Tensor converted;
  std::vector<const Boundary*> seen;
  bool matched(const at::Tensor& x) const {
    return input && !input->expired() && input->lock().get() == x.unsafeGetTensorImpl() &&
           x._version() == version;
  }
};

// NOTE: [Redistribution memo]
// Several tagged ops often read one activation (wq, wk, wv; w1, w3). Each would move it to
// the same layout; the memo hands them one moved tensor, so one collective runs forward and
// autograd sums the gradients before the one backward collective. Entries die with their
// source tensor (or its next in-place change) and are few.
struct MemoEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> source;
  int64_t version;
  bool grad_mode;
  SpecPtr target;
  at::Tensor result;
};

struct ThreadState {
  const Boundary* last = nullptr;         // boundaries live as long as their module's table entry
  std::optional<std::string> open_shard;  // NOTE: [Plain dropout on local shards]
  std::unordered_map<const ModuleInput*, std::pair<std::shared_ptr<const ModuleInput>, Entered>>
      entered;
  std::vector<MemoEntry> memo;
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

bool encloses(const Boundary& leaf, const ModuleInput* m) {
  for (const auto& e : leaf.enclosing)
    if (e.get() == m) return true;
  return false;
}

at::Tensor memo_redistribute(const at::Tensor& x, const SpecPtr& target) {
  auto& memo = state().memo;
  const bool grad = at::GradMode::is_enabled();
  const auto* impl = x.unsafeGetTensorImpl();
  memo.erase(std::remove_if(memo.begin(), memo.end(),
                            [](const MemoEntry& e) { return e.source.expired(); }),
             memo.end());
  for (const auto& e : memo)
    if (e.source.lock().get() == impl && e.version == x._version() && e.grad_mode == grad &&
        *e.target == *target)
      return e.result;
  at::Tensor out = redistribute(x, target);
  constexpr size_t kMemoSize = 16;
  if (memo.size() >= kMemoSize) memo.erase(memo.begin());
  memo.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(x.getIntrusivePtr()), x._version(), grad,
                  target, out});
  return out;
}

// NOTE: [Plain inputs on a slice]
// parallelize_module(m, mesh["tp"]) lays the parameters out on the root mesh, replicated over
// its other dims ("dp"), so that they meet activations sharded over "dp" in one op. A plain
// input is therefore read as the same value on every rank of those dims. Feeding each dp group
// its own batch as a plain tensor (the habit of a tensor-parallel model per dp group) would
// make that false, and the parameters' gradients would mix the groups' rows. So the boundary
// compares a digest of the plain input across the other dims (one all-gather of one integer
// over them, only for plain inputs on a slice of a larger mesh) and raises on every rank when
// they differ, naming the two ways to say what is meant.
uint64_t content_digest(const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous();
  const auto* bytes = static_cast<const char*>(c.data_ptr());
  const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
  uint64_t h = std::hash<std::string_view>()(std::string_view(bytes, n));
  for (int64_t d : t.sizes()) h = h * 1000003u ^ static_cast<uint64_t>(d);
  return h * 31u + static_cast<uint64_t>(t.scalar_type());
}

void check_plain_same_across_other_dims(const TpMesh& mesh, const at::Tensor& x,
                                        const std::string& where) {
  const DeviceMesh& root = mesh.root;
  if (root.ndim() == 1 || !root.contains_this_rank()) return;
  std::vector<std::string> others;
  for (int64_t d = 0; d < root.ndim(); ++d)
    if (d != mesh.dim && root.size(d) > 1) others.push_back(root.dim_names().at(d));
  if (others.empty()) return;
  const DeviceMesh across = root[others];
  const auto all = comm::all_gather_ints(
      across.mesh_group(), {static_cast<int64_t>(content_digest(x)), x.dim() > 0 ? x.size(0) : 1});
  bool same = true;
  for (const auto& v : all) same = same && v[0] == all[0][0];
  if (same) return;
  std::string names, rows;
  for (const auto& n : others) names += (names.empty() ? "'" : ", '") + n + "'";
  for (const auto& v : all) rows += (rows.empty() ? "" : ", ") + std::to_string(v[1]);
  const std::string root_dims = [&] {
    std::string p;
    for (int64_t d = 0; d < root.ndim(); ++d)
      p += (d ? ", " : "") + std::string(d == mesh.dim ? "Replicate()" : "Shard(0)");
    return p;
  }();
  TORCH_CHECK(false, "tessera: ", where, ": the plain input (this rank's shape ",
              shape_str(x.sizes().vec()), ") differs across mesh dim(s) ", names, " of ",
              root.str(), " (first-dim sizes there: ", rows, "). The tensor-parallel parameters ",
              "live on that mesh, replicated over ", names,
              ", so a plain input is read as one "
              "value on all of its ranks. If each group feeds its own batch, say so: "
              "tessera::from_local(x, mesh, {",
              root_dims, "}) (a batch split over ", names,
              "; Tessera then sums the parameters' gradients over ", names,
              " itself, so do not all-reduce them again), or parallelize each group's model on a "
              "1-D mesh of its own ranks (DeviceMesh(device, {tp}, ranks)) and reduce the "
              "gradients yourself");
}

}  // namespace

std::optional<std::string> open_local_shard() { return state().open_shard; }

at::Tensor convert(const TpMesh& mesh, const Convert& c, const at::Tensor& input,
                   const std::string& where) {
  at::Tensor x = input;
  if (!x.defined()) return x;
  if (!is_dtensor(x)) {
    if (!c.plain) return x;
    TORCH_CHECK(x.dim() > 0 || !c.plain->is_shard(), "tessera: ", where,
                ": cannot read a 0-dim plain tensor as ", c.plain->str());
    const Placement p = c.plain->is_shard() ? c.plain->normalized(x.dim()) : *c.plain;
    FromLocalOptions o;
    if (p.is_shard())  // exact sizes: the parameter's table when it fixes them, else exchanged
      o.sizes = c.plain_table && p.dim() == x.dim() - 1 ? ShardSizes::Given(p.dim(), *c.plain_table)
                                                        : ShardSizes::Infer();
    check_plain_same_across_other_dims(mesh, x, where);
    x = from_local(x, mesh.root, mesh.with({}, p), o);
    // Plain shards read back (a Rowwise input), or a plain input entering (the next forward):
    // no local shard is open any more.
    state().open_shard.reset();
  } else {
    const auto& s = spec(x);
    TORCH_CHECK(s.mesh() == mesh.root, "tessera: ", where, ": the input lives on ", s.mesh().str(),
                " but the tensor-parallel parameters live on ", mesh.root.str(), " (dim ", mesh.dim,
                "); redistribute it onto that mesh first");
  }
  if (c.desired) {
    const auto& s = spec(x);
    const Placement want = c.desired->is_shard() ? c.desired->normalized(s.ndim()) : *c.desired;
    Placements target = mesh.with(s.placements(), want);
    std::vector<ShardTable> tables = s.shard_tables();
    bool change = target != s.placements();
    const bool table_applies = want.is_shard() && c.desired_table && want.dim() == s.ndim() - 1;
    if (table_applies && s.mesh_dims_sharding(want.dim()) == std::vector<int64_t>{mesh.dim} &&
        s.shard_table(want.dim()) != *c.desired_table) {
      change = true;
    }
    if (change) {
      // Tables of dims whose sharding changes follow the target (chunk unless given).
      DTensorSpec base = s.with_placements(target);
      std::vector<ShardTable> t = base.shard_tables();
      for (size_t d = 0; d < t.size(); ++d) {
        const bool same_mesh_dims = s.mesh_dims_sharding(static_cast<int64_t>(d)) ==
                                    base.mesh_dims_sharding(static_cast<int64_t>(d));
        if (same_mesh_dims && !tables[d].empty()) t[d] = tables[d];
      }
      if (table_applies && base.mesh_dims_sharding(want.dim()) == std::vector<int64_t>{mesh.dim})
        t[static_cast<size_t>(want.dim())] = *c.desired_table;
      auto spec_ptr = std::make_shared<DTensorSpec>(s.mesh(), target, s.sizes(), s.dtype(), t);
      x = memo_redistribute(x, spec_ptr);
    }
  }
  if (c.to_local) {
    const bool shard = spec(x).placements()[static_cast<size_t>(mesh.dim)].is_shard();
    x = to_local(x);
    if (shard) state().open_shard = where;
  }
  return x;
}

at::Tensor enter(const Boundary& b, const at::Tensor& input, const char* op) {
  auto& st = state();
  at::Tensor x = input;
  for (const auto& m : b.enclosing) {
    auto& slot = st.entered[m.get()];
    if (!slot.first) slot.first = m;
    Entered& e = slot.second;
    const bool inside = st.last && encloses(*st.last, m.get()) &&
                        std::find(e.seen.begin(), e.seen.end(), &b) == e.seen.end();
    if (!inside) {
      e = Entered();
      if (x.defined()) {
        e.input.emplace(x.getIntrusivePtr());
        e.version = x._version();
      }
    }
    e.seen.push_back(&b);
    if (x.defined() && e.matched(x)) {
      if (!e.converted.defined())
        e.converted = convert(m->mesh, m->convert, x,
                              std::string(op) + " in '" + m->fqn + "' (PrepareModuleInput)");
      x = e.converted;
    }
  }
  st.last = &b;
  if (b.input)
    x = convert(b.mesh, *b.input, x, std::string(op) + " of '" + b.fqn + "' (" + b.style + ")");
  return x;
}

at::Tensor leave(const Boundary& b, const at::Tensor& output, const char* op, bool allow_local) {
  at::Tensor y = output;
  for (const auto& c : b.outputs) {
    const std::string where = std::string(op) + " output of '" + b.fqn + "' (" + b.style + ")";
    TORCH_CHECK(
        allow_local || !c.to_local, "tessera: ", where, ": LibTorch's F::linear adds the ",
        "bias after the matrix product when the input has other than 2 dims, so the ",
        "output must stay distributed until then. Use use_local_output(false) on this ",
        "style (model code runs unchanged on distributed outputs), or a Linear without bias");
    y = convert(b.mesh, c, y, where);
  }
  return y;
}

}  // namespace tessera::tp::detail
