// baton-demo: the best thing baton runs today. A four-stage pipeline of actors over two
// worker threads streams pieces through bounded registers; a progress line every half second
// and the per-actor report at the end show where the time goes.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/kernels.h"

namespace {

struct Options {
  std::int64_t pieces = 200'000;
  std::int64_t kernel_ns = 2'000;
  int slots = 2;
  std::int64_t elements = 256;
};

[[noreturn]] void usage(const char* bad) {
  if (bad) std::fprintf(stderr, "baton-demo: bad argument '%s'\n", bad);
  std::fprintf(stderr,
               "usage: baton-demo [--pieces N] [--kernel-ns NS] [--slots S] [--elements E]\n"
               "  Streams N pieces of E floats through source -> stage1 -> stage2 -> sink on two\n"
               "  worker threads; each stage spins NS ns per piece; S slots per register.\n");
  std::exit(bad ? 2 : 0);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") usage(nullptr);
    if (i + 1 >= argc) usage(argv[i]);
    char* end = nullptr;
    long long v = std::strtoll(argv[i + 1], &end, 10);
    if (end == argv[i + 1] || *end != '\0' || v < 0) usage(argv[i + 1]);
    if (a == "--pieces") o.pieces = v;
    else if (a == "--kernel-ns") o.kernel_ns = v;
    else if (a == "--slots" && v >= 1) o.slots = static_cast<int>(v);
    else if (a == "--elements" && v >= 1) o.elements = v;
    else usage(argv[i]);
    ++i;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse(argc, argv);
  using namespace baton;
  Plan plan;
  auto reg = [&](std::string name) {
    return plan.add_register({.name = std::move(name), .shape = {opt.elements}, .dtype = f32, .slots = opt.slots});
  };
  auto r_src = reg("source.out");
  auto r_s1 = reg("stage1.out");
  auto r_s2 = reg("stage2.out");
  Attrs spin{{"ns", opt.kernel_ns}};
  plan.add_actor({.name = "source", .kind = ActorKind::source, .op = "fill_piece",
                  .where = {.stream = 0}, .outputs = {r_src}, .pieces = opt.pieces});
  plan.add_actor({.name = "stage1", .op = "spin_ns", .where = {.stream = 0}, .inputs = {{r_src}},
                  .outputs = {r_s1}, .attrs = spin});
  plan.add_actor({.name = "stage2", .op = "spin_ns", .where = {.stream = 1}, .inputs = {{r_s1}},
                  .outputs = {r_s2}, .attrs = spin});
  plan.add_actor({.name = "sink", .op = "noop", .where = {.stream = 1}, .inputs = {{r_s2}}});

  fmt::print("baton-demo: {} pieces of f32[{}] through a 4-actor pipeline on 2 threads, {} ns per stage, "
             "{} slots per register\n\n{}\n",
             opt.pieces, opt.elements, opt.kernel_ns, opt.slots, plan.to_text());
  try {
    auto kernels = KernelRegistry::with_builtin_kernels();
    Runtime rt(plan, kernels);
    RunReport report;
    std::thread runner([&] { report = rt.run(); });
    // A progress line while it runs (the dashboard comes with the monitoring step).
    std::uint64_t last = 0;
    auto t_last = std::chrono::steady_clock::now();
    bool tty = isatty(fileno(stdout));
    while (true) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      auto snap = rt.snapshot();
      std::uint64_t done = 0;
      for (const auto& a : snap.actors) {
        if (a.name == "sink") done = a.acts;
      }
      if (done >= static_cast<std::uint64_t>(opt.pieces)) break;
      auto now = std::chrono::steady_clock::now();
      double rate = static_cast<double>(done - last) / std::chrono::duration<double>(now - t_last).count();
      last = done;
      t_last = now;
      fmt::print("{}pieces {:>9}/{} ({:5.1f}%)  {:>10.0f} pieces/s{}", tty ? "\r" : "", done, opt.pieces,
                 100.0 * static_cast<double>(done) / static_cast<double>(opt.pieces), rate, tty ? "" : "\n");
      std::fflush(stdout);
    }
    runner.join();
    fmt::print("\n\ndone in {:.3f} s: {:.0f} pieces/s end to end, {} messages, {} parks\n\n{}",
               report.wall_s, static_cast<double>(opt.pieces) / report.wall_s, report.messages,
               report.parks, report.metrics.table());
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-demo: {}\n", e.what());
    return 1;
  }
  return 0;
}
