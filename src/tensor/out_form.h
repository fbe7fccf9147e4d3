#pragma once
// The registry's internal surface for the fallback: out= overloads without a rule of their
// own (NOTE: [out= forms] in rule_registry.cpp), and rules that read the head-tail order.
#include <optional>

#include <ATen/core/dispatch/Dispatcher.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops::detail {

// An out= form's borrowed rule: the functional sibling's, and that sibling to run.
struct OutFormRule {
  const Rule* rule = nullptr;
  std::optional<c10::OperatorHandle> functional;
  size_t outs = 0;  // written kwarg-only arguments, the schema's last ones
};

// The written kwarg-only arguments (out=, values=, grad_input=) an op ends with; 0 if none.
size_t out_argument_count(const c10::FunctionSchema& schema);

// For an out= form without its own rule: its functional sibling's rule, if that has one.
// Cached per operator.
const OutFormRule* find_out_form_rule(const c10::OperatorHandle& op);

// A rule registered for `qualified_name` that is handed head-tail specs as they are (it plans
// for the stored order itself) instead of the natural ones (NOTE: [Head-tail arguments] in
// tensor/fallback.cpp). Only rules that check for the order may ask.
void let_rule_see_head_tail(const std::string& qualified_name);
bool rule_sees_head_tail(const c10::OperatorHandle& op);

}  // namespace tessera::ops::detail
