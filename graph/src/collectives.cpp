#include "baton/graph/collectives.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

namespace baton {

std::vector<std::int64_t> chunk_offsets(std::int64_t n, std::int64_t parts) {
  std::vector<std::int64_t> off{0};
  for (std::int64_t c = 0; c < parts; ++c) off.push_back(off.back() + n / parts + (c < n % parts ? 1 : 0));
  return off;
}

namespace {

template <class T>
void add_kernels(KernelRegistry& k, DType dt) {
  k.add_fn("allreduce.split", DeviceType::cpu, dt, [](KernelContext& ctx) {
    auto in = ctx.inputs[0]->data<T>();
    std::size_t at = 0;
    for (Tensor* out : ctx.outputs) {
      auto o = out->data<T>();
      std::copy(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + o.size()),
                o.begin());
      at += o.size();
    }
  });
  k.add_fn("allreduce.sum", DeviceType::cpu, dt, [](KernelContext& ctx) {
    auto out = ctx.outputs[0]->data<T>();
    auto first = ctx.inputs[0]->data<T>();
    std::copy(first.begin(), first.end(), out.begin());
    for (std::size_t j = 1; j < ctx.inputs.size(); ++j) {
      auto in = ctx.inputs[j]->data<T>();
      for (std::size_t i = 0; i < out.size(); ++i) out[i] += in[i];
    }
  });
  k.add_fn("allreduce.concat", DeviceType::cpu, dt, [](KernelContext& ctx) {
    auto out = ctx.outputs[0]->data<T>();
    std::size_t at = 0;
    for (const Tensor* in : ctx.inputs) {
      auto i = in->data<T>();
      std::copy(i.begin(), i.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
      at += i.size();
    }
  });
}

}  // namespace

void add_collective_kernels(KernelRegistry& kernels) {
  add_kernels<float>(kernels, DType::f32);
  add_kernels<double>(kernels, DType::f64);
}

std::vector<RegisterIndex> add_allreduce(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                         const Shape& shape, DType dtype, std::int32_t result_slots) {
  if (members.empty()) throw std::invalid_argument(fmt::format("all-reduce '{}' has no members", name));
  const auto n = static_cast<std::int64_t>(members.size());
  const auto off = chunk_offsets(numel(shape), n);
  auto len = [&](std::int64_t c) { return off[static_cast<std::size_t>(c) + 1] - off[static_cast<std::size_t>(c)]; };
  // chunk[j][c]: member j's chunk c.
  std::vector<std::vector<RegisterIndex>> chunk(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    const AllReduceMember& m = members[static_cast<std::size_t>(j)];
    for (std::int64_t c = 0; c < n; ++c) {
      chunk[static_cast<std::size_t>(j)].push_back(plan.add_register(
          {.name = fmt::format("{}.chunk{}{}", name, c, m.suffix), .shape = {len(c)}, .dtype = dtype, .slots = 2}));
    }
    plan.add_actor({.name = name + ".split" + m.suffix, .op = "allreduce.split", .dtype = dtype, .where = m.where,
                    .inputs = {{m.input}}, .outputs = chunk[static_cast<std::size_t>(j)]});
  }
  std::vector<RegisterIndex> sums;
  for (std::int64_t c = 0; c < n; ++c) {
    const AllReduceMember& owner = members[static_cast<std::size_t>(c)];
    std::vector<InputPort> ins;
    for (std::int64_t j = 0; j < n; ++j) ins.push_back({chunk[static_cast<std::size_t>(j)][static_cast<std::size_t>(c)]});
    const std::string sum_name = fmt::format("{}.sum{}{}", name, c, owner.suffix);
    sums.push_back(plan.add_register({.name = sum_name, .shape = {len(c)}, .dtype = dtype, .slots = 2}));
    plan.add_actor({.name = sum_name, .op = "allreduce.sum", .dtype = dtype, .where = owner.where,
                    .inputs = std::move(ins), .outputs = {sums.back()}});
  }
  std::vector<RegisterIndex> results;
  for (const AllReduceMember& m : members) {
    std::vector<InputPort> ins;
    for (RegisterIndex r : sums) ins.push_back({r});
    results.push_back(
        plan.add_register({.name = name + ".allreduced" + m.suffix, .shape = shape, .dtype = dtype, .slots = result_slots}));
    plan.add_actor({.name = name + ".concat" + m.suffix, .op = "allreduce.concat", .dtype = dtype, .where = m.where,
                    .inputs = std::move(ins), .outputs = {results.back()}});
  }
  return results;
}

}  // namespace baton
