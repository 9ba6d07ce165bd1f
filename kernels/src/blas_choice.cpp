// OpenBLAS's kernels chosen by the CPU's features where its own detection falls back
// (blas_choice.h says why and how).
#include "baton/kernels/blas_choice.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <strings.h>

#include <fmt/format.h>

extern "C" char* openblas_get_corename(void);

namespace baton::blas {

namespace {

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && (a.empty() || ::strncasecmp(a.data(), b.data(), a.size()) == 0);
}

std::string running_core() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "";
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

CpuFeatures features_from(std::string_view flags) {
  CpuFeatures f;
  std::istringstream words{std::string(flags)};
  std::string w;
  while (words >> w) {
    if (w == "avx") f.avx = true;
    if (w == "avx2") f.avx2 = true;
    if (w == "fma") f.fma = true;
    if (w == "avx512f") f.avx512f = true;
    if (w == "avx512bw") f.avx512bw = true;
    if (w == "avx512vl") f.avx512vl = true;
    if (w == "avx512dq") f.avx512dq = true;
  }
  return f;
}

CpuFeatures cpu_features() {
  if (const char* pretend = env("BATON_BLAS_PRETEND_FLAGS")) return features_from(pretend);
  CpuFeatures f;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // Before any constructor of libgcc's may have run: its data is filled on request.
  __builtin_cpu_init();
  // libgcc reports AVX and AVX-512 only where the operating system saves their registers (XCR0).
  f.avx = __builtin_cpu_supports("avx");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
#endif
  return f;
}

Isa isa_of(const CpuFeatures& f) {
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) return Isa::avx512;
  if (f.avx2 && f.fma) return Isa::avx2;
  if (f.avx) return Isa::avx;
  return Isa::sse;
}

bool isa_of_core(std::string_view core, Isa& isa) {
  // OpenBLAS 0.3.21's x86-64 DYNAMIC_ARCH families (driver/others/dynamic.c, corename[]),
  // by the widest instructions their kernels use.
  static constexpr std::array<std::pair<std::string_view, Isa>, 26> cores{{
      {"Prescott", Isa::sse},     {"Core2", Isa::sse},        {"Penryn", Isa::sse},
      {"Dunnington", Isa::sse},   {"Nehalem", Isa::sse},      {"Atom", Isa::sse},
      {"Opteron", Isa::sse},      {"Opteron_SSE3", Isa::sse}, {"Barcelona", Isa::sse},
      {"Nano", Isa::sse},         {"Katmai", Isa::sse},       {"Coppermine", Isa::sse},
      {"Northwood", Isa::sse},    {"Banias", Isa::sse},       {"Athlon", Isa::sse},
      {"Bobcat", Isa::sse},       {"Sandybridge", Isa::avx},  {"Bulldozer", Isa::avx},
      {"Piledriver", Isa::avx},   {"Steamroller", Isa::avx},  {"Excavator", Isa::avx},
      {"Haswell", Isa::avx2},     {"Zen", Isa::avx2},         {"SkylakeX", Isa::avx512},
      {"Cooperlake", Isa::avx512}, {"SapphireRapids", Isa::avx512},
  }};
  for (const auto& [name, level] : cores) {
    if (same_name(name, core)) {
      isa = level;
      return true;
    }
  }
  return false;
}

std::string_view core_for(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "SkylakeX";
    case Isa::avx2: return "Haswell";
    case Isa::avx: return "Sandybridge";
    case Isa::sse: break;
  }
  return "";
}

std::string feature_words(const CpuFeatures& f) {
  std::string out;
  auto add = [&](bool has, const char* word) {
    if (!has) return;
    if (!out.empty()) out += ' ';
    out += word;
  };
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512dq, "avx512dq");
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.avx, "avx");
  return out.empty() ? "no AVX" : out;
}

Decision decide(std::string_view running, const CpuFeatures& features, const char* user_coretype,
                const char* detected_marker, const char* choice) {
  Decision d;
  d.core = std::string(running);
  d.features = isa_of(features);
  if (choice != nullptr && (same_name(choice, "off") || same_name(choice, "0"))) {
    d.kind = Decision::Kind::off;
    return d;
  }
  const std::string_view want = core_for(d.features);
  if (user_coretype != nullptr && *user_coretype != '\0') {
    // Ours when an earlier start set it (the marker) to what these features ask for; a value
    // the user set themselves otherwise (or a marker inherited from elsewhere with another).
    if (detected_marker != nullptr && *detected_marker != '\0' && same_name(user_coretype, want)) {
      d.kind = Decision::Kind::chosen;
      d.detected = detected_marker;
      return d;
    }
    d.kind = Decision::Kind::user;
    Isa asked = Isa::sse;
    d.below_features = isa_of_core(user_coretype, asked) && asked < d.features;
    return d;
  }
  d.detected = d.core;
  Isa got = Isa::sse;
  if (!want.empty() && isa_of_core(running, got) && got < d.features) {
    d.kind = Decision::Kind::start_again;
    d.core = std::string(want);
  }
  return d;
}

// Read by ops_tensor.cpp, so that every program whose kernels use BLAS links this file, and with
// it the constructor below (a static library's object is linked only when something needs it).
extern const int linked;
const int linked = 1;

namespace {

// The constructor's, before main. A function's static, not a global: the file's globals are
// initialised by a constructor of their own, which may run after this one and undo it.
Decision& made_before_main() {
  static Decision made;
  return made;
}

/// Runs before main, after libopenblas's own constructor (a shared library the executable
/// depends on is initialised first). glibc passes the program's arguments to constructors.
__attribute__((constructor)) void choose_blas_kernels(int /*argc*/, char** argv, char** /*envp*/) {
  const char* pretend = env("BATON_BLAS_PRETEND_DETECTED");  // tests: as if OpenBLAS had chosen it
  const char* user = env("OPENBLAS_CORETYPE");
  Decision& made = made_before_main();
  made = decide(pretend != nullptr && user == nullptr ? std::string(pretend) : running_core(), cpu_features(), user,
                env("BATON_BLAS_DETECTED"), env("BATON_BLAS_CHOICE"));
  if (made.kind != Decision::Kind::start_again || argv == nullptr || argv[0] == nullptr) return;
  ::setenv("OPENBLAS_CORETYPE", made.core.c_str(), 1);
  ::setenv("BATON_BLAS_DETECTED", made.detected.c_str(), 1);
  std::array<char, 4096> self{};
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  ::execv(n > 0 ? self.data() : "/proc/self/exe", argv);
  // Still here: go on with what OpenBLAS chose, and say so (once, before main).
  const int err = errno;
  ::unsetenv("OPENBLAS_CORETYPE");
  ::unsetenv("BATON_BLAS_DETECTED");
  std::fprintf(stderr, "baton: OpenBLAS chose its %s kernels, below what this CPU runs (%s); starting again with "
                       "OPENBLAS_CORETYPE=%s failed (%s): going on with them\n",
               made.detected.c_str(), made.core.c_str(), made.core.c_str(), std::strerror(err));
  made.kind = Decision::Kind::kept;
  made.core = made.detected;
}

}  // namespace

Decision decision() {
  Decision d = made_before_main();
  d.core = running_core();
  return d;
}

std::string summary() {
  const Decision d = decision();
  const std::string words = feature_words(cpu_features());
  switch (d.kind) {
    case Decision::Kind::chosen:
      return fmt::format("OpenBLAS {} kernels (chosen from the CPU's {}: OpenBLAS's own detection gave {})", d.core,
                         words, d.detected);
    case Decision::Kind::user:
      if (d.below_features) {
        return fmt::format("OpenBLAS {} kernels (OPENBLAS_CORETYPE={} from the environment, kept; the CPU runs {}'s: "
                           "unset it for them)",
                           d.core, std::getenv("OPENBLAS_CORETYPE"), core_for(d.features));
      }
      return fmt::format("OpenBLAS {} kernels (OPENBLAS_CORETYPE={} from the environment, kept)", d.core,
                         std::getenv("OPENBLAS_CORETYPE"));
    case Decision::Kind::off:
      return fmt::format("OpenBLAS {} kernels (its own choice; BATON_BLAS_CHOICE=off)", d.core);
    case Decision::Kind::start_again:  // not left in this state: execv replaced the process or it became kept
    case Decision::Kind::kept:
      break;
  }
  Isa got = Isa::sse;
  if (isa_of_core(d.core, got) && got < d.features) {  // only where starting again failed
    return fmt::format("OpenBLAS {} kernels (its own choice, below the CPU's {}: starting again with {} failed)",
                       d.core, words, core_for(d.features));
  }
  return fmt::format("OpenBLAS {} kernels (its own choice; the CPU has {})", d.core, words);
}

}  // namespace baton::blas
