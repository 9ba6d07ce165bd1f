// baton-plan: what a training layout will do on a cluster, before it runs there
// (docs/planning.md). The layout's real plan, compiled by baton's compiler, run on a virtual
// clock with each act's cost from the cluster's device profile.
//
//   baton-plan simulate --model gpt --layers 4 --d-model 256 --heads 8 --seq 128 --vocab 512
//       --global-batch 16 --micro-batch 4 --pp 2 --schedule 1f1b --cluster cpu:2
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include "bytes.h"
#include "planner.h"

namespace {

using namespace baton::planner;

void add_layout_options(CLI::App& app, Layout& l) {
  app.add_option("--model", l.model, "mlp, gpt or llama")->capture_default_str();
  app.add_option("--layers", l.layers, "transformer blocks (mlp: hidden layers)")->capture_default_str();
  app.add_option("--d-model", l.d_model, "model width")->capture_default_str();
  app.add_option("--heads", l.heads, "attention heads")->capture_default_str();
  app.add_option("--kv-heads", l.kv_heads, "llama: key/value heads (0: --heads)")->capture_default_str();
  app.add_option("--ffn-hidden", l.ffn_hidden, "llama: the MLP's width (0: 8 d / 3 rounded up to 32)")->capture_default_str();
  app.add_option("--seq", l.seq, "tokens per sample")->capture_default_str();
  app.add_option("--vocab", l.vocab, "vocabulary size")->capture_default_str();
  app.add_option("--hidden", l.hidden, "mlp: hidden width")->capture_default_str();
  app.add_option("--global-batch", l.global_batch, "samples per step over all replicas")->capture_default_str();
  app.add_option("--micro-batch", l.micro_batch, "samples per micro-batch (0: global batch / dp)")->capture_default_str();
  app.add_option("--dp", l.dp, "data-parallel replicas")->capture_default_str();
  app.add_option("--tp", l.tp, "tensor-parallel shards")->capture_default_str();
  app.add_option("--pp", l.pp, "pipeline devices")->capture_default_str();
  app.add_option("--schedule", l.schedule, "gpipe, 1f1b, interleaved, zb-h1, zb-v or 2bw")->capture_default_str();
  app.add_option("--virtual-stages", l.virtual_stages, "interleaved: stages per device")->capture_default_str();
  app.add_option("--zero", l.zero, "ZeRO stage 0..3")->capture_default_str();
  app.add_option("--recompute", l.recompute, "none, selective or full")->capture_default_str();
  app.add_option("--dtype", l.dtype, "f32, or bf16 (mixed precision)")->capture_default_str();
  app.add_option("--threads", l.threads, "worker threads per device (baton-train --threads)")->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"baton-plan: a training layout's step time, memory and critical path on a cluster, from its real plan "
               "run on a virtual clock (docs/planning.md)"};
  app.require_subcommand(1);
  Layout layout;
  std::string cluster = "cpu:1";
  int gpus_per_node = 0;
  bool json = false;
  std::string trace;
  int repeats = 3;
  bool check = false;
  CLI::App* sim = app.add_subcommand("simulate", "predict one layout");
  add_layout_options(*sim, layout);
  sim->add_option("--cluster", cluster, "NAME:N: a100-40gb, a100-80gb, h100-sxm, h200 or cpu (this machine, measured)")
      ->capture_default_str();
  sim->add_option("--gpus-per-node", gpus_per_node, "devices per node (0: the profile's, 8 for GPUs)");
  sim->add_flag("--json", json, "one JSON object instead of text");
  sim->add_option("--trace", trace, "write the simulated steps as a Chrome/Perfetto trace to FILE");
  sim->add_flag("--check", check,
                 "cpu: also train the layout here for a few steps and print the measured step time and each op's "
                 "kernel time beside the prediction's");
  sim->add_option("--repeats", repeats, "cpu: timed runs of each kernel (the median counts)")->capture_default_str();
  Layout base;
  std::string search_cluster = "cpu";
  int gpus = 0;
  int top = 10;
  double time_limit = 600;
  CLI::App* find = app.add_subcommand(
      "search", "the fastest layouts that fit: dp x tp x pp, micro-batch and schedule (those given are held fixed), "
                "each with the first of ZeRO's stages, then recomputation, at which it fits");
  add_layout_options(*find, base);
  find->add_option("--cluster", search_cluster, "NAME or NAME:N (with --gpus N)")->capture_default_str();
  find->add_option("--gpus", gpus, "devices to lay the job out on");
  find->add_option("--gpus-per-node", gpus_per_node, "devices per node (0: the profile's, 8 for GPUs)");
  std::string memory_limit;
  find->add_option("--memory-limit", memory_limit, "bytes a device may hold (512MiB, 40GiB; default: the profile's)");
  find->add_option("--top", top, "how many layouts to print")->capture_default_str();
  find->add_option("--time-limit", time_limit, "seconds of searching at most")->capture_default_str();
  find->add_flag("--json", json, "a JSON array, fastest first");
  CLI11_PARSE(app, argc, argv);
  if (find->parsed()) {
    try {
      const std::string spec = gpus > 0 ? fmt::format("{}:{}", search_cluster, gpus) : search_cluster;
      Cluster c = parse_cluster(spec, gpus_per_node);
      if (!memory_limit.empty()) c.device.memory_bytes = baton::parse_bytes("--memory-limit", memory_limit);
      SearchFixed f;
      const auto given = [&](const char* flag) { return find->get_option(flag)->count() > 0; };
      if (given("--dp")) f.dp = base.dp;
      if (given("--tp")) f.tp = base.tp;
      if (given("--pp")) f.pp = base.pp;
      if (given("--zero")) f.zero = base.zero;
      if (given("--micro-batch")) f.micro_batch = base.micro_batch;
      if (given("--schedule")) f.schedule = base.schedule;
      if (given("--recompute")) f.recompute = base.recompute;
      const SearchResult r = search(base, c, f, {.top = top, .time_limit_s = time_limit});
      if (json) {
        std::string out = "[";
        for (std::size_t i = 0; i < r.ranked.size(); ++i) out += (i == 0 ? "" : ",") + to_json(r.ranked[i]);
        fmt::print("{}]\n", out);
      } else {
        fmt::print("baton-plan search: {} on {}: {} layouts, {} predictions, {} refused, {:.1f} s\n", base.model, spec,
                   r.candidates, r.evaluated, r.refused, r.wall_s);
        for (const std::string& n : r.notes) fmt::print("  note: {}\n", n);
        if (r.ranked.empty()) fmt::print("  no layout fits\n");
        for (std::size_t i = 0; i < r.ranked.size(); ++i) {
          const Prediction& p = r.ranked[i];
          fmt::print("  {:>2}. {:<70} {:.4g} s/step  {:.4g} samples/s  MFU {:.1f}%  bubble {:.0f}%  {}\n", i + 1,
                     p.layout.str(), p.step_time_s, p.samples_per_s, 100 * p.mfu, 100 * p.bubble_fraction,
                     baton::format_bytes(p.peak_memory_bytes));
        }
      }
    } catch (const std::exception& e) {
      fmt::print(stderr, "baton-plan: {}\n", e.what());
      return 2;
    }
    return 0;
  }
  try {
    const Cluster c = parse_cluster(cluster, gpus_per_node);
    const Prediction p = predict(layout, c, {.repeats = repeats, .keep_acts = !trace.empty()});
    if (!trace.empty()) {
      std::ofstream f(trace);
      f << to_trace(p);
      if (!f) throw std::runtime_error(fmt::format("--trace {}: cannot write it", trace));
    }
    if (json) {
      fmt::print("{}\n", to_json(p));
    } else {
      fmt::print("{}", to_text(p));
      if (!c.device.source.empty()) fmt::print("  device       {}: {}\n", c.device.name, c.device.source);
    }
    if (check) {
      if (!c.device.measured) throw std::invalid_argument("--check trains the layout here: it needs --cluster cpu:N");
      const Measured m = measure(layout, 12, 2);
      fmt::print("measured here: step time {:.4g} s ({:+.1f}% predicted)\n  {:<24} {:>12} {:>12}\n", m.step_s,
                 (p.step_time_s - m.step_s) / m.step_s * 100, "op", "predicted", "measured");
      for (const auto& [op, s] : p.act_s_by_op) {
        const auto it = m.kernel_s_per_act.find(op);
        fmt::print("  {:<24} {:>9.1f} us {:>9.1f} us\n", op, s * 1e6, it == m.kernel_s_per_act.end() ? 0.0 : it->second * 1e6);
      }
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-plan: {}\n", e.what());
    return 2;
  }
  return 0;
}
