// Parameter servers (lowering.h; TrainConfig::sync "ps"): the trained weights and their
// optimizer state sharded over server actors, as ps-lite and BytePS shard keys. A weight's
// server adds the replicas' summed gradients of it in replica order and runs its optimizer; each
// replica repeats the weights it pulls from there, once a step:
//
//   replica r: ... backward ──> accumulate(M) ──> grad.w  ──┐ (one register a step, to the server)
//   server k:  add(grad.w@dp0, grad.w@dp1) ──> ... ──> variable.w@ps<k> (delay 1 + staleness)
//   replica r: w.repeat(M) <── variable.w@ps<k>'s step register (one a step, from the server)
//
// Across ranks the transfers pass moves both registers, so a worker sends and receives each
// weight's bytes once a step, against a ring all-reduce's 2 (n - 1) / n each way.
#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "lowering.h"

namespace baton::passes::detail {

void check_sync(const TrainConfig& cfg) {
  if (cfg.sync != "allreduce" && cfg.sync != "ps") {
    throw GraphError(fmt::format("sync '{}': allreduce or ps", cfg.sync));
  }
  if (cfg.rejoin && cfg.sync != "ps") {
    throw GraphError(fmt::format("a rank comes back to a running job under parameter servers (sync ps), not sync {}",
                                 cfg.sync));
  }
  if (cfg.sync == "allreduce") {
    if (cfg.staleness != 0) {
      throw GraphError(fmt::format("staleness {} is for parameter servers (sync ps); an all-reduce is synchronous",
                                   cfg.staleness));
    }
    if (!cfg.server_places.empty()) throw GraphError("server places are for parameter servers (sync ps)");
    return;
  }
  if (cfg.servers < 1) throw GraphError(fmt::format("sync ps needs at least 1 server, not {}", cfg.servers));
  if (cfg.staleness < 0) throw GraphError(fmt::format("staleness must be >= 0, not {}", cfg.staleness));
  auto refuse = [&](const std::string& other, const std::string& why) {
    throw GraphError(fmt::format("sync ps with {}: {}", other, why));
  };
  if (cfg.zero > 0) {
    refuse(fmt::format("zero {}", cfg.zero),
           "the servers already hold the optimizer state, sharded over them; use one or the other");
  }
  if (cfg.pp > 1) refuse(fmt::format("pp {}", cfg.pp), "servers for pipeline stages are not built yet");
  if (cfg.tp > 1) refuse(fmt::format("tp {}", cfg.tp), "servers for tensor-parallel shards are not built yet");
  if (cfg.grad_compression != "none") {
    refuse(fmt::format("grad compression {}", cfg.grad_compression), "the servers add gradients in full precision");
  }
  if (cfg.optimizer.clip_norm > 0) {
    refuse(fmt::format("clip norm {}", cfg.optimizer.clip_norm),
           "the global norm would need every server's shard; not built yet");
  }
  if (cfg.schedule == "2bw") refuse("schedule 2bw", "use --staleness 1 for updates a step late");
  if (!cfg.server_places.empty() && cfg.server_places.size() != static_cast<std::size_t>(cfg.servers)) {
    throw GraphError(fmt::format("{} servers but {} server places are given", cfg.servers, cfg.server_places.size()));
  }
  const int replicas = cfg.dp * cfg.pp * cfg.tp;
  if (cfg.server_places.empty() && replicas + cfg.servers > Device::max_index + 1) {
    throw GraphError(fmt::format("dp {} and {} servers need {} in-process devices; at most {}", cfg.dp, cfg.servers,
                                 replicas + cfg.servers, Device::max_index + 1));
  }
}

Placement server_place(const TrainConfig& cfg, int k) {
  if (!cfg.server_places.empty()) return cfg.server_places[static_cast<std::size_t>(k)];
  return Placement{.device = Device{DeviceType::cpu, static_cast<std::uint8_t>(cfg.dp * cfg.pp * cfg.tp + k)}};
}

std::pair<RegisterIndex, Placement> lower_ps_loss(std::vector<PlanBuilder>& replicas,
                                                  const std::vector<RegisterIndex>& loss_regs, DType loss_dt,
                                                  int loss_place, const TrainConfig& cfg) {
  PlanBuilder& first = replicas.front();
  PlanBuilder s{first.g, first.plan, first.kernels};
  s.places = {server_place(cfg, 0)};
  s.suffix = "@ps0";
  const DType pair_dt = loss_dt == DType::f64 ? DType::f64 : DType::f32;
  first.kernels.add_fn("loss.count", DeviceType::cpu, loss_dt, [loss_dt, pair_dt](KernelContext& ctx) {
    const Tensor& t = *ctx.inputs[0];
    const double loss = scalar_value(t, loss_dt);
    if (pair_dt == DType::f64) {
      ctx.outputs[0]->data<double>()[0] = loss;
      ctx.outputs[0]->data<double>()[1] = 1.0;
    } else {
      ctx.outputs[0]->data<float>()[0] = static_cast<float>(loss);
      ctx.outputs[0]->data<float>()[1] = 1.0f;
    }
  });
  std::vector<RegisterIndex> pairs;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    PlanBuilder& b = replicas[r];
    const RegisterIndex pair = b.add_register("loss.count", Shape{2}, pair_dt, 2);
    b.plan.add_actor({.name = b.named("loss.count"),
                      .op = "loss.count",
                      .dtype = loss_dt,
                      .where = b.host(forward_stream, loss_place),
                      .inputs = {{loss_regs[r]}},
                      .outputs = {pair}});
    pairs.push_back(pair);
  }
  RegisterIndex sum = pairs[0];
  for (std::size_t r = 1; r < pairs.size(); ++r) {
    const RegisterIndex out = s.add_register(fmt::format("loss.sum{}", r), Shape{2}, pair_dt, 2);
    s.plan.add_actor({.name = s.named(fmt::format("loss.add{}", r)),
                      .op = "add",
                      .dtype = pair_dt,
                      .where = s.host(forward_stream, 0),
                      .inputs = {{sum}, {pairs[r]}},
                      .outputs = {out}});
    sum = out;
  }
  return {sum, s.host(forward_stream, 0)};
}

std::map<int, RegisterIndex> lower_parameter_servers(std::vector<PlanBuilder>& replicas, const Differentiated& d,
                                                     const GradientInputs& grad_sum, const Stages& st,
                                                     const TrainConfig& cfg, ParameterStore& params) {
  PlanBuilder& first = replicas.front();
  const int n = cfg.servers;
  std::vector<PlanBuilder> servers;
  for (int k = 0; k < n; ++k) {
    PlanBuilder b{first.g, first.plan, first.kernels};
    b.places = {server_place(cfg, k)};
    b.loss_id = first.loss_id;
    b.first_piece = first.first_piece;
    b.suffix = fmt::format("@ps{}", k);
    servers.push_back(std::move(b));
  }
  // Shards by bytes (largest weight first, each to the server with the fewest bytes so far; ties
  // to the lower server): every rank computes the same assignment.
  std::vector<std::size_t> order(d.trained.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  auto bytes = [&](std::size_t i) {
    const Value& v = d.trained[i].first;
    return numel(v.shape()) * static_cast<std::int64_t>(size_of(v.dtype()));
  };
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
  std::vector<std::int64_t> load(static_cast<std::size_t>(n), 0);
  std::vector<int> server_of(d.trained.size());
  for (std::size_t i : order) {
    const auto k = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    server_of[i] = static_cast<int>(k);
    load[k] += bytes(i);
  }
  std::map<int, RegisterIndex> steps;
  const std::uint8_t stream = backward_stream(cfg);
  for (std::size_t i = 0; i < d.trained.size(); ++i) {
    const Value& v = d.trained[i].first;
    PlanBuilder& s = servers[static_cast<std::size_t>(server_of[i])];
    // The replicas' gradients added in replica order (the same sums as on one device for two).
    RegisterIndex sum = grad_sum[0].at(v.id());
    for (std::size_t r = 1; r < grad_sum.size(); ++r) {
      const RegisterIndex out = s.add_register(fmt::format("grad.{}.sum{}", v.name(), r), v.shape(), v.dtype(), 1);
      s.plan.add_actor({.name = s.named(fmt::format("grad.{}.add{}", v.name(), r)),
                        .op = "add",
                        .dtype = v.dtype(),
                        .where = s.at(stream, 0),
                        .inputs = {{sum}, {grad_sum[r].at(v.id())}},
                        .outputs = {out},
                        .role = ActorRole::collective});
      sum = out;
    }
    const GradientAt grad{{sum}, 0};
    steps[v.id()] = lower_variable(s, 0, v.id(), &grad, nullptr, st, cfg, params, /*with_repeat=*/false);
  }
  return steps;
}

}  // namespace baton::passes::detail
