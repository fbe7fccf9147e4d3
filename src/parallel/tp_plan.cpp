// parallelize_module: resolves plan paths, checks every entry, applies the styles in order,
// then links module boundaries (which PrepareModuleInput encloses which tagged op).
#include <fnmatch.h>

#include <sstream>

#include <c10/util/Exception.h>

#include "tessera/parallel/module.h"
#include "tessera/parallel/tensor_parallel.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tessera/tensor/random.h"
#include "tp_boundary.h"

namespace tessera {

namespace tp::detail {
void set_current_path(const std::string& path);
}

namespace {

struct Target {
  torch::nn::Module* module;
  std::string path;
};

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> atoms;
  std::string cur;
  for (char ch : key) {
    if (ch == '.') {
      atoms.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  atoms.push_back(cur);
  return atoms;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// One atom per level, matched as a shell glob against the children's names.
std::vector<Target> resolve(torch::nn::Module& root, const std::string& key) {
  std::vector<Target> level{{&root, ""}};
  if (key.empty()) return level;
  for (const auto& atom : split_path(key)) {
    TORCH_CHECK(!atom.empty(), "tessera: parallelize_module: plan entry '", key,
                "' has an empty path component");
    std::vector<Target> next;
    std::string children;
    for (const auto& t : level) {
      for (const auto& child : t.module->named_children()) {
        if (children.size() < 200) children += (children.empty() ? "" : ", ") + child.key();
        if (fnmatch(atom.c_str(), child.key().c_str(), 0) == 0)
          next.push_back({child.value().get(), join(t.path, child.key())});
      }
    }
    TORCH_CHECK(!next.empty(), "tessera: parallelize_module: plan entry '", key,
                "' matches no submodule: nothing matches '", atom, "' among the children (",
                children.empty() ? std::string("none") : children, ") of ",
                level.size() == 1 ? "'" + level[0].path + "'" : "the modules matched so far");
    level = std::move(next);
  }
  return level;
}

bool subtree_has_anchor(torch::nn::Module& m) {
  for (const auto& item : modules_with_self(m)) {
    auto b = tp::detail::find_boundary(*item.second);
    if (b && b->anchored && b->has_param_style) return true;
  }
  return false;
}

// Gives every tagged op's boundary the PrepareModuleInputs that enclose it, and its output
// conversions; rejects what no tagged op can carry out.
void link(torch::nn::Module& m, const std::string& path,
          std::vector<std::shared_ptr<const tp::detail::ModuleInput>> chain) {
  if (auto own = tp::detail::module_input(m)) {
    TORCH_CHECK(subtree_has_anchor(m), "tessera: parallelize_module: the input conversion of '",
                own->fqn, "' (PrepareModuleInput or a style's set_input_conversion): no module ",
                "inside it has a parameter style on a ", tp::detail::anchored_module_names(),
                ", so Tessera cannot see its input (LibTorch modules ",
                "have no hooks). Give the modules that consume the input a style, or pass the ",
                "module distributed inputs (tessera::from_local / distribute_tensor)");
    chain.push_back(own);
  }
  auto b = tp::detail::find_boundary(m);
  auto outputs = tp::detail::module_outputs(m);
  if (!outputs.empty()) {
    TORCH_CHECK(b && b->anchored && b->has_param_style,
                "tessera: parallelize_module: ", "PrepareModuleOutput on '",
                path.empty() ? std::string("<root>") : path,
                "' (or a style's add_output_conversion there): ",
                "Tessera converts outputs where a tensor-parallel ",
                tp::detail::anchored_module_names(),
                " produces them, and this module is not one (LibTorch modules have no hooks). Put ",
                "the layouts on the style of the module that produces the output, e.g. "
                "RowwiseParallel().output_layouts(...)");
  }
  if (b) {
    b->enclosing = b->anchored ? chain : decltype(chain){};
    b->outputs = b->style_outputs;
    for (auto& o : outputs) b->outputs.push_back(o);
  }
  for (const auto& child : m.named_children()) link(*child.value(), join(path, child.key()), chain);
}

}  // namespace

void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int> src_data_rank) {
  tp::detail::ensure_anchors_registered();
  (void)tp::detail::TpMesh::of(mesh, "parallelize_module");
  // Resolve and check every entry before any style runs.
  std::vector<std::pair<std::vector<Target>, ParallelStyle*>> steps;
  for (const auto& [key, style] : plan) steps.push_back({resolve(module, key), &*style});
  for (auto& [targets, style] : steps) {
    style->src_data_rank = src_data_rank;
    for (auto& t : targets) {
      tp::detail::set_current_path(t.path);
      tp::detail::begin_application();
      try {
        style->apply(*t.module, mesh);
      } catch (...) {
        tp::detail::set_current_path("");
        throw;
      }
    }
  }
  tp::detail::set_current_path("");
  link(module, "", {});
}

void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int> src_data_rank) {
  struct Borrowed : ParallelStyle {
    const ParallelStyle& s;
    explicit Borrowed(const ParallelStyle& st) : s(st) {}
    void apply(torch::nn::Module& m, const DeviceMesh& mesh) const override {
      const_cast<ParallelStyle&>(s).src_data_rank = src_data_rank;
      s.apply(m, mesh);
    }
    std::string name() const override { return s.name(); }
  };
  parallelize_module(
      module, mesh,
      ParallelizePlan{{"", std::shared_ptr<ParallelStyle>(std::make_shared<Borrowed>(style))}},
      src_data_rank);
}

namespace tp {
std::string describe_parameter(const at::Tensor& parameter) {
  auto b = detail::boundary_of(parameter);
  return b ? "'" + b->fqn + "' (" + b->style + ")" : std::string();
}
}  // namespace tp

}  // namespace tessera
