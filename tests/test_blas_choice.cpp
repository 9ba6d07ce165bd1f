// OpenBLAS's kernels chosen from the CPU's features where its own detection falls back
// (kernels/include/baton/kernels/blas_choice.h): the decision on its own, and a whole program
// that starts itself again before main.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "baton/kernels/blas_choice.h"
#include "skip.h"

using namespace baton;
using blas::Decision;
using blas::Isa;

namespace {

const blas::CpuFeatures avx512 = blas::features_from("avx512f avx512bw avx512vl avx512dq avx2 fma avx");
const blas::CpuFeatures avx2 = blas::features_from("avx2 fma avx");

}  // namespace

TEST_CASE("BlasChoice.FeaturesAndLevels") {
  CHECK(blas::isa_of(avx512) == Isa::avx512);
  CHECK(blas::isa_of(avx2) == Isa::avx2);
  // AVX-512 F alone (Knights Landing) is not what the SkylakeX kernels use; AVX2 without FMA is
  // not what Haswell's use.
  CHECK(blas::isa_of(blas::features_from("avx512f avx2 fma avx")) == Isa::avx2);
  CHECK(blas::isa_of(blas::features_from("avx2 avx")) == Isa::avx);
  CHECK(blas::isa_of(blas::features_from("sse3 ssse3")) == Isa::sse);
  CHECK(blas::feature_words(avx2) == "avx2 fma avx");
  Isa isa = Isa::avx512;
  CHECK(blas::isa_of_core("Prescott", isa));
  CHECK(isa == Isa::sse);
  CHECK(blas::isa_of_core("zen", isa));  // OPENBLAS_CORETYPE is read without regard to case
  CHECK(isa == Isa::avx2);
  CHECK(blas::isa_of_core("COOPERLAKE", isa));
  CHECK(isa == Isa::avx512);
  CHECK_FALSE(blas::isa_of_core("armv8", isa));  // another architecture's: never second-guessed
  CHECK(blas::core_for(Isa::avx512) == "SkylakeX");
  CHECK(blas::core_for(Isa::avx2) == "Haswell");
  CHECK(blas::core_for(Isa::sse).empty());
}

TEST_CASE("BlasChoice.Decide") {
  SUBCASE("a masked CPU model: OpenBLAS fell back to SSE3, the features say AVX-512") {
    const Decision d = blas::decide("Prescott", avx512, nullptr, nullptr, nullptr);
    CHECK(d.kind == Decision::Kind::start_again);
    CHECK(d.core == "SkylakeX");
    CHECK(d.detected == "Prescott");
  }
  SUBCASE("AVX2 with FMA, OpenBLAS's Sandybridge (AVX) kernels") {
    const Decision d = blas::decide("Sandybridge", avx2, nullptr, nullptr, nullptr);
    CHECK(d.kind == Decision::Kind::start_again);
    CHECK(d.core == "Haswell");
  }
  SUBCASE("OpenBLAS's own choice as good as the features: kept") {
    CHECK(blas::decide("Haswell", avx2, nullptr, nullptr, nullptr).kind == Decision::Kind::kept);
    CHECK(blas::decide("Cooperlake", avx512, nullptr, nullptr, nullptr).kind == Decision::Kind::kept);
    // Above the features (OpenBLAS knows more than these flags say): kept, never lowered.
    CHECK(blas::decide("SkylakeX", avx2, nullptr, nullptr, nullptr).kind == Decision::Kind::kept);
    CHECK(blas::decide("armv8", avx512, nullptr, nullptr, nullptr).kind == Decision::Kind::kept);
  }
  SUBCASE("the user's OPENBLAS_CORETYPE is kept, and said where it is below the CPU") {
    Decision d = blas::decide("Prescott", avx2, "Prescott", nullptr, nullptr);
    CHECK(d.kind == Decision::Kind::user);
    CHECK(d.below_features);
    d = blas::decide("Haswell", avx2, "Haswell", nullptr, nullptr);
    CHECK(d.kind == Decision::Kind::user);
    CHECK_FALSE(d.below_features);
    // A marker inherited from a baton program that chose another core: the value is the user's.
    d = blas::decide("Sandybridge", avx2, "Sandybridge", "Prescott", nullptr);
    CHECK(d.kind == Decision::Kind::user);
    CHECK(d.below_features);
  }
  SUBCASE("after the start again: chosen, with what OpenBLAS had detected") {
    const Decision d = blas::decide("Haswell", avx2, "Haswell", "Prescott", nullptr);
    CHECK(d.kind == Decision::Kind::chosen);
    CHECK(d.detected == "Prescott");
  }
  SUBCASE("BATON_BLAS_CHOICE=off") {
    CHECK(blas::decide("Prescott", avx512, nullptr, nullptr, "off").kind == Decision::Kind::off);
  }
}

// The whole path: this test program, started with OpenBLAS's detection pretended to have fallen
// back to Prescott (BATON_BLAS_PRETEND_DETECTED) on a CPU pretended to have AVX2 and FMA only,
// starts itself again before main with OPENBLAS_CORETYPE=Haswell; OpenBLAS then runs Haswell's
// kernels, and the summary says why. With the user's own OPENBLAS_CORETYPE it is kept and said.
TEST_CASE("BlasChoice.StartsAgainWithTheFeaturesKernels" * doctest::timeout(120)) {
  if (const char* child = std::getenv("BATON_TEST_BLAS_CHILD"); child != nullptr) {
    std::printf("CORE %s\nSUMMARY %s\n", blas::decision().core.c_str(), blas::summary().c_str());
    std::fflush(stdout);
    return;
  }
  if (blas::isa_of(blas::cpu_features()) < Isa::avx2) {
    return test::skip(test::Missing::cpu_feature, "this CPU has no AVX2 with FMA: OpenBLAS could not run Haswell's kernels");
  }
  const std::string exe = [] {
    char buf[4096] = {};
    const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
    return std::string(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  }();
  REQUIRE(!exe.empty());
  auto run = [&](const std::string& env) {
    const std::string cmd =
        fmt::format("env -u OPENBLAS_CORETYPE -u BATON_BLAS_DETECTED -u BATON_BLAS_CHOICE BATON_TEST_BLAS_CHILD=1 "
                    "BATON_BLAS_PRETEND_DETECTED=Prescott BATON_BLAS_PRETEND_FLAGS='avx2 fma avx' {} timeout 60 '{}' "
                    "-tc='BlasChoice.StartsAgainWithTheFeaturesKernels' 2>&1",
                    env, exe);
    std::string out;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    REQUIRE(pipe != nullptr);
    char buf[4096];
    while (std::fgets(buf, sizeof buf, pipe) != nullptr) out += buf;
    const int status = ::pclose(pipe);
    INFO(out);
    CHECK(status == 0);
    return out;
  };
  auto field = [](const std::string& out, const std::string& name) {
    const auto at = out.find(name + " ");
    if (at == std::string::npos) return std::string();
    return out.substr(at + name.size() + 1, out.find('\n', at) - at - name.size() - 1);
  };

  const std::string chosen = run("");
  INFO(chosen);
  CHECK(field(chosen, "CORE") == "Haswell");  // OpenBLAS's own name for what it runs now
  CHECK(field(chosen, "SUMMARY") ==
        "OpenBLAS Haswell kernels (chosen from the CPU's avx2 fma avx: OpenBLAS's own detection gave Prescott)");

  const std::string kept = run("OPENBLAS_CORETYPE=Sandybridge");
  INFO(kept);
  CHECK(field(kept, "CORE") == "Sandybridge");
  CHECK(field(kept, "SUMMARY") == "OpenBLAS Sandybridge kernels (OPENBLAS_CORETYPE=Sandybridge from the environment, "
                                  "kept; the CPU runs Haswell's: unset it for them)");

  const std::string off = run("BATON_BLAS_CHOICE=off");
  INFO(off);
  CHECK(field(off, "SUMMARY").starts_with("OpenBLAS "));
  CHECK(field(off, "SUMMARY").ends_with("(its own choice; BATON_BLAS_CHOICE=off)"));
}
