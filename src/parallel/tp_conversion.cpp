// The style boundary: ParallelStyle::set_input_conversion / add_output_conversion, the one
// path every style (built-in or the user's) converts a module's inputs and outputs through
// (NOTE: [Style conversions] in tensor_parallel.h).
#include <algorithm>
#include <atomic>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include "tessera/parallel/tensor_parallel.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tp_boundary.h"

namespace tessera {

namespace tp {

std::string IoConversion::str() const {
  std::string s = "{plain: " + (plain ? plain->str() : std::string("keep"));
  s += ", desired: " + (desired ? desired->str() : std::string("keep"));
  return s + (to_local ? ", local}" : "}");
}

namespace detail {

namespace {

struct Application {
  uint64_t id = 0;
  std::vector<const torch::nn::Module*> laid_out;
};

Application& application() {
  thread_local Application a;
  return a;
}

std::string where(const ParallelStyle& style) {
  return "parallelize_module: " + style.name() + " on '" + current_path() + "'";
}

std::string type_of(const torch::nn::Module& m) {
  std::ostringstream os;
  m.pretty_print(os);
  return os.str();
}

}  // namespace

void begin_application() {
  static std::atomic<uint64_t> next{0};
  auto& a = application();
  a.id = ++next;
  a.laid_out.clear();
}

void note_laid_out(const torch::nn::Module& module) { application().laid_out.push_back(&module); }

bool laid_out_in_application(const torch::nn::Module& module) {
  const auto& l = application().laid_out;
  return std::find(l.begin(), l.end(), &module) != l.end();
}

BoundaryPtr claim_boundary(torch::nn::Module& module, const ParallelStyle& style,
                           const DeviceMesh& mesh) {
  BoundaryPtr b = boundary_for(module);
  const uint64_t id = application().id;
  if (b->has_param_style && b->application == id) return b;
  TORCH_CHECK(!b->has_param_style, "tessera: ", where(style), ": the module already has ", b->style,
              " (from plan entry '", b->fqn, "'); a module takes one parameter style");
  b->has_param_style = true;
  b->application = id;
  b->fqn = current_path();
  b->style = style.name() + " on " + type_of(module);
  b->mesh = TpMesh::of(mesh, where(style));
  // See NOTE: [Linear with bias] in tp_anchors.cpp.
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module))
    b->linear_bias = linear->options.bias();
  return b;
}

void style_conversion(const ParallelStyle& style, torch::nn::Module& module, const DeviceMesh& mesh,
                      Convert conversion, bool input) {
  const TpMesh tp_mesh = TpMesh::of(mesh, where(style));
  if (laid_out_in_application(module) && is_anchored_leaf(module)) {
    // Around the module's own op: its parameters carry the boundary to it.
    BoundaryPtr b = claim_boundary(module, style, mesh);
    b->anchored = true;
    if (input)
      b->input = std::move(conversion);
    else
      b->style_outputs.push_back(std::move(conversion));
    for (const auto& p : module.named_parameters(/*recurse=*/false))
      if (p.value().defined() && is_dtensor(p.value())) tag_parameter(p.value(), b);
    return;
  }
  if (!input) {  // linked (and checked) by parallelize_module
    add_module_output(module, std::move(conversion));
    return;
  }
  if (auto other = module_input(module)) {
    TORCH_CHECK(false, "tessera: ", where(style), ": the module's input already has a ",
                "conversion ", other->convert.str(), " (from plan entry '", other->fqn,
                "'); a module's input takes one. Merge the two into one style");
  }
  auto mi = std::make_shared<ModuleInput>();
  mi->fqn = current_path();
  mi->mesh = tp_mesh;
  mi->convert = std::move(conversion);
  set_module_input(module, std::move(mi));
}

}  // namespace detail
}  // namespace tp

void ParallelStyle::set_input_conversion(torch::nn::Module& module, const DeviceMesh& mesh,
                                         tp::IoConversion conversion) const {
  tp::detail::style_conversion(*this, module, mesh, std::move(conversion), /*input=*/true);
}

void ParallelStyle::add_output_conversion(torch::nn::Module& module, const DeviceMesh& mesh,
                                          tp::IoConversion conversion) const {
  tp::detail::style_conversion(*this, module, mesh, std::move(conversion), /*input=*/false);
}

}  // namespace tessera
