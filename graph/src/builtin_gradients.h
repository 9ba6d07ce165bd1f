#pragma once
// Private to graph/src: the built-in ops' gradient rules (autodiff.cpp), which the op table
// (op_registry.cpp) holds beside the registered ops'.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "baton/graph/op_registry.h"

namespace baton::detail {

using GradientRule = std::function<Value(const GradientArgs&)>;

std::vector<std::pair<std::string, GradientRule>> builtin_gradient_rules();

}  // namespace baton::detail
