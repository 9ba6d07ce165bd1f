#pragma once
// Kernels that check the runtime from the inside: every register carries a pattern that says
// which register and which piece it holds, and every reader checks it before and after
// lingering over it, so a piece seen twice, out of order, skipped or overwritten while still
// being read fails the run with the actor's name.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels.h"

namespace baton::test {

inline constexpr std::int64_t pattern_elements = 16;

inline std::int64_t pattern_value(std::int64_t reg, std::int64_t piece, std::int64_t i) {
  return ((reg + 1) * 1'000'003 + piece) * pattern_elements + i;
}

inline void write_pattern(Tensor& t, std::int64_t reg, std::int64_t piece) {
  auto d = t.data<std::int64_t>();
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = pattern_value(reg, piece, static_cast<std::int64_t>(i));
}

inline void check_pattern(const Tensor& t, std::int64_t reg, std::int64_t piece, const char* when) {
  auto d = t.data<std::int64_t>();
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (d[i] != pattern_value(reg, piece, static_cast<std::int64_t>(i))) {
      std::int64_t seen = d[i] / pattern_elements;
      throw std::runtime_error(fmt::format(
          "{}: register {} piece {} element {} holds register {} piece {}", when, reg, piece, i,
          seen / 1'000'003 - 1, seen % 1'000'003));
    }
  }
}

/// "pattern": writes the pattern of (its output register ids, piece) after checking that each
/// input holds (its register id, piece). attrs: in_regs, out_regs (register ids, in port
/// order); linger_every N: every N-th act yields the thread between two checks of its inputs,
/// so a producer that rewrote a slot still being read would be caught.
class PatternKernel final : public Kernel {
 public:
  explicit PatternKernel(const KernelConfig& cfg) {
    auto get = [&](const char* key) {
      auto it = cfg.attrs.values().find(key);
      return it == cfg.attrs.values().end() ? std::vector<std::int64_t>{}
                                            : std::get<std::vector<std::int64_t>>(it->second);
    };
    in_regs_ = get("in_regs");
    out_regs_ = get("out_regs");
    linger_every_ = cfg.attrs.get_int("linger_every", 0);
    fail_at_ = cfg.attrs.get_int("fail_at", -1);
    sleep_us_ = cfg.attrs.get_int("sleep_us", 0);
    name_ = std::string(cfg.actor);
  }
  void compute(KernelContext& ctx) override {
    if (ctx.piece == fail_at_) throw std::runtime_error(fmt::format("injected failure at piece {}", ctx.piece));
    if (sleep_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    for (std::size_t i = 0; i < ctx.inputs.size(); ++i) {
      check_pattern(*ctx.inputs[i], in_regs_.at(i), ctx.piece, "before reading");
    }
    if (linger_every_ > 0 && ctx.piece % linger_every_ == 0) {
      std::this_thread::yield();
      for (std::size_t i = 0; i < ctx.inputs.size(); ++i) {
        check_pattern(*ctx.inputs[i], in_regs_.at(i), ctx.piece, "after lingering");
      }
    }
    for (std::size_t o = 0; o < ctx.outputs.size(); ++o) write_pattern(*ctx.outputs[o], out_regs_.at(o), ctx.piece);
  }

 private:
  std::vector<std::int64_t> in_regs_, out_regs_;
  std::int64_t linger_every_ = 0;
  std::int64_t fail_at_ = -1;   // attrs fail_at: throw at this piece (fault tests)
  std::int64_t sleep_us_ = 0;   // attrs sleep_us: slow every act down (a run that lasts)
  std::string name_;
};

/// The built-in kernels plus "pattern" (i64, cpu).
inline KernelRegistry checking_registry() {
  auto reg = KernelRegistry::with_builtin_kernels();
  reg.add("pattern", DeviceType::cpu, DType::i64,
          [](const KernelConfig& cfg) { return std::make_unique<PatternKernel>(cfg); });
  return reg;
}

}  // namespace baton::test
