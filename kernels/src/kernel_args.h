#pragma once
// Private to kernels/src: how a kernel fetches the tensors it relies on, with an error naming
// the op (and the tensor's role, where given) when one is missing.
#include <cstddef>
#include <stdexcept>

#include <fmt/format.h>

#include "baton/kernels/kernel.h"

namespace baton::detail {

inline const Tensor& need_input(const KernelContext& ctx, std::size_t i, const char* op,
                                const char* role = nullptr) {
  if (ctx.inputs.size() <= i || ctx.inputs[i] == nullptr || !ctx.inputs[i]->defined()) {
    throw std::invalid_argument(role == nullptr ? fmt::format("{}: input {} is missing", op, i)
                                                : fmt::format("{}: input {} ({}) is missing", op, i, role));
  }
  return *ctx.inputs[i];
}

inline Tensor& need_output(const KernelContext& ctx, std::size_t i, const char* op,
                           const char* role = nullptr) {
  if (ctx.outputs.size() <= i || ctx.outputs[i] == nullptr || !ctx.outputs[i]->defined()) {
    throw std::invalid_argument(role == nullptr ? fmt::format("{}: output {} is missing", op, i)
                                                : fmt::format("{}: output {} ({}) is missing", op, i, role));
  }
  return *ctx.outputs[i];
}

}  // namespace baton::detail
