// baton-bench-stream: whether the host still sits between the kernels of an asynchronous
// device (step 11's stream-ordered handshakes). A chain of short kernels on one sim stream (a
// sim device: baton/kernels/sim.h, a thread running enqueued work in order, as a CUDA stream),
// run as a plan of actors, against the same kernels enqueued back to back on a sim stream by a
// plain loop (no actors): the loop is what a stream can do at best, so the ratio says how much
// of it the actors keep. Measured in the same run, interleaved, best of several repetitions.
//
//   baton-bench-stream                 kernels of 2 us, 4 per piece, 20 000 pieces
//   baton-bench-stream --quick         2 000 pieces (the CTest smoke run)
//   baton-bench-stream --kernel-us X   another kernel length
//
// Cases (one JSON line each; "value" is kernels per second, "reference" the plain loop's):
//   sim_chain_<X>us            source -> 4 kernels -> sink, all on sim:0 stream 0
//   sim_chain_<X>us_2streams   the same, the kernels alternating between streams 0 and 1
//                              (every edge an event edge)
//   sim_chain_<X>us_host_wait  one stream, RuntimeSettings::stream_order off: every act waits
//                              for its stream before its requests and acks go out (a host round
//                              trip per act, as before step 11)
// Goal (issue 18): >= 0.9x the plain loop on one stream.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/kernels.h"
#include "json_line.h"
#include "load.h"

namespace {

using namespace baton;

constexpr int kernels_per_piece = 4;

struct Options {
  std::int64_t pieces = 20'000;
  std::int64_t kernel_ns = 2'000;
  int repeats = 5;
};

/// source -> `kernels_per_piece` spinning kernels -> sink, every actor on a sim device.
Plan chain(const Options& o, bool two_streams) {
  Plan p;
  const Device sim0 = Device::parse("sim:0");
  auto reg = [&](int i) {
    return p.add_register(
        {.name = fmt::format("r{}", i), .shape = {16}, .dtype = DType::f32, .slots = 2});
  };
  RegisterIndex prev = reg(0);
  p.add_actor({.name = "source",
               .kind = ActorKind::source,
               .op = "fill_piece",
               .where = {.device = sim0},
               .outputs = {prev},
               .pieces = o.pieces});
  for (int i = 1; i <= kernels_per_piece; ++i) {
    const RegisterIndex next = reg(i);
    const auto stream = static_cast<std::uint8_t>(two_streams ? i % 2 : 0);
    p.add_actor({.name = fmt::format("k{}", i),
                 .op = "spin_ns",
                 .where = {.device = sim0, .stream = stream},
                 .inputs = {{prev}},
                 .outputs = {next},
                 .attrs = {{"ns", o.kernel_ns}}});
    prev = next;
  }
  p.add_actor({.name = "sink", .op = "noop", .where = {.device = sim0}, .inputs = {{prev}}});
  return p;
}

double run_actors(const Plan& plan, const KernelRegistry& reg, bool stream_order) {
  RuntimeSettings s;
  s.stream_order = stream_order;
  s.time_accounting = false;
  Runtime rt(plan, reg, s);
  return rt.run().wall_s;  // until the streams have run every kernel
}

/// The same kernels (fill, the spins, the sink's noop) enqueued by a plain loop on one stream.
double run_loop(const Options& o, const KernelRegistry& reg) {
  const Device cpu{};
  Attrs spin_attrs{{"ns", o.kernel_ns}};
  Attrs none;
  auto fill = reg.create("fill_piece", {"loop.fill", cpu, DType::f32, none});
  auto spin = reg.create("spin_ns", {"loop.spin", cpu, DType::f32, spin_attrs});
  auto sink = reg.create("noop", {"loop.sink", cpu, DType::f32, none});
  std::vector<Tensor> regs;
  for (int i = 0; i <= kernels_per_piece; ++i) regs.push_back(Tensor::zeros({16}, DType::f32));
  auto stream = sim::Stream::create(Device::parse("sim:0"), "loop");
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t piece = 0; piece < o.pieces; ++piece) {
    stream->enqueue([&, piece] {
      Tensor* out = &regs[0];
      KernelContext c{{}, {&out, 1}, piece};
      fill->compute(c);
    });
    for (int i = 1; i <= kernels_per_piece; ++i) {
      stream->enqueue([&, i, piece] {
        const Tensor* in = &regs[static_cast<std::size_t>(i - 1)];
        Tensor* out = &regs[static_cast<std::size_t>(i)];
        KernelContext c{{&in, 1}, {&out, 1}, piece};
        spin->compute(c);
      });
    }
    stream->enqueue([&, piece] {
      const Tensor* in = &regs.back();
      KernelContext c{{&in, 1}, {}, piece};
      sink->compute(c);
    });
  }
  stream->synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  // The sim stream's thread spins the kernels; the worker enqueues: two busy threads.
  bench::load().start(argc, argv, 2);
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.pieces = 2'000;
      o.repeats = 3;
    } else if (a == "--kernel-us" && i + 1 < argc) {
      o.kernel_ns = static_cast<std::int64_t>(std::stod(argv[++i]) * 1000);
    } else if (a == "--pieces" && i + 1 < argc) {
      o.pieces = std::stoll(argv[++i]);
    } else {
      fmt::print(
          stderr,
          "usage: baton-bench-stream [--quick] [--kernel-us X] [--pieces N] [--allow-load]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  const Plan one = chain(o, false), two = chain(o, true);
  const double kernels = static_cast<double>(o.pieces) * kernels_per_piece;
  struct Case {
    std::string name;
    const Plan* plan;
    bool stream_order;
    double best = 1e300;
  };
  const std::string us = fmt::format("{:g}us", static_cast<double>(o.kernel_ns) / 1000.0);
  std::vector<Case> cases = {{"sim_chain_" + us, &one, true},
                             {"sim_chain_" + us + "_2streams", &two, true},
                             {"sim_chain_" + us + "_host_wait", &one, false}};
  double loop_best = 1e300;
  for (int r = 0; r < o.repeats; ++r) {  // interleaved, so a slow moment hurts every side alike
    loop_best = std::min(loop_best, run_loop(o, reg));
    for (Case& c : cases) c.best = std::min(c.best, run_actors(*c.plan, reg, c.stream_order));
  }
  for (const Case& c : cases) {
    bench::JsonLine line("stream", c.name);
    line.add("value", kernels / c.best)
        .add("unit", "kernels/s")
        .better(bench::Better::higher)
        .add("reference", kernels / loop_best)
        .add("reference_name", "the same kernels enqueued back to back on one sim stream by a loop")
        .compare("ratio", kernels / c.best, kernels / loop_best)
        .add("kernel_ns", o.kernel_ns)
        .add("pieces", o.pieces)
        .add("kernels_per_piece", std::int64_t{kernels_per_piece})
        .add("repeats", std::int64_t{o.repeats})
        .add("wall_s", c.best)
        .add("reference_wall_s", loop_best);
    line.print();
  }
  return 0;
}
