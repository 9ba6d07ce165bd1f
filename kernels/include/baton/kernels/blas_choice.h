#pragma once
// Which OpenBLAS kernels run, and why (#55 item 3).
//
// Debian's OpenBLAS is built with DYNAMIC_ARCH: when the library loads, it picks its kernels
// by the CPU's family and model. On a model it does not know (a newer one, or a VM that masks it
// as "Intel Xeon Processor") it falls back to its SSE3 kernels ("Prescott"), several times slower
// than the AVX2 or AVX-512 ones the CPU runs. The choice is made in the library's constructor,
// before main, from OPENBLAS_CORETYPE when set; it cannot be changed afterwards.
//
// So every program that links baton's kernels checks, before main (a constructor of this file,
// which runs after the library's), what OpenBLAS chose against the CPU's own features (cpuid:
// AVX-512 F/BW/VL/DQ, AVX2 with FMA, AVX). Where OpenBLAS chose kernels of a lower instruction
// set than the CPU runs, the program starts itself again (execv of /proc/self/exe, the same
// arguments, the same process id: so under baton-launch, mpirun and srun alike) with
// OPENBLAS_CORETYPE naming the kernels the features allow, and BATON_BLAS_DETECTED naming what
// OpenBLAS had chosen (which also keeps it from starting again). An OPENBLAS_CORETYPE the user
// set is kept, and said (with a word where it is below what the CPU runs). BATON_BLAS_CHOICE=off
// turns the check off.
#include <string>
#include <string_view>

namespace baton::blas {

/// Instruction-set levels of OpenBLAS's x86-64 kernel families, lowest first.
enum class Isa { sse = 0, avx = 1, avx2 = 2, avx512 = 3 };

/// The CPU features that decide the level (x86-64; all false elsewhere).
struct CpuFeatures {
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
};

/// This CPU's (cpuid, with the operating system's support of the wider registers), or, for a
/// test, the words of BATON_BLAS_PRETEND_FLAGS ("avx2 fma", as /proc/cpuinfo spells them).
CpuFeatures cpu_features();
/// The features named in `flags` (space-separated, /proc/cpuinfo's spelling); others ignored.
CpuFeatures features_from(std::string_view flags);
/// The highest level the features allow: AVX-512 needs F, BW, VL and DQ (OpenBLAS's SkylakeX
/// kernels use all four), AVX2 needs FMA as well.
Isa isa_of(const CpuFeatures& f);
/// The level of one of OpenBLAS's x86-64 core names (case-insensitive: "Prescott", "Haswell",
/// "Zen", "SkylakeX", "Cooperlake", ...); false for a name it does not know (another
/// architecture's, or a newer one), which is never second-guessed.
bool isa_of_core(std::string_view core, Isa& isa);
/// The kernels to ask for at a level: SkylakeX, Haswell, Sandybridge; "" for SSE.
std::string_view core_for(Isa isa);
/// The features as words, highest first ("avx512f avx512bw avx512vl avx512dq avx2 fma avx").
std::string feature_words(const CpuFeatures& f);

/// What to do, decided from what the process sees (pure: tested on its own).
struct Decision {
  enum class Kind {
    kept,        // OpenBLAS's own choice is as good as the features allow (or unknown): nothing
    start_again, // ask for `core` instead of `detected`: set the environment and execv
    user,        // the user's OPENBLAS_CORETYPE: kept
    chosen,      // an earlier start (this process's, or a parent baton program's) chose `core`
    off,         // BATON_BLAS_CHOICE=off
  } kind = Kind::kept;
  std::string detected;  // OpenBLAS's own choice (from BATON_BLAS_DETECTED when chosen)
  std::string core;      // the kernels that run (start_again: that will run)
  Isa features = Isa::sse;
  bool below_features = false;  // user: the kernels asked for are below what the CPU runs
};
/// `running`: openblas_get_corename(); `user_coretype`: OPENBLAS_CORETYPE (nullptr: unset);
/// `detected_marker`: BATON_BLAS_DETECTED (nullptr: unset); `choice`: BATON_BLAS_CHOICE.
Decision decide(std::string_view running, const CpuFeatures& features, const char* user_coretype,
                const char* detected_marker, const char* choice);

/// The decision this process made before main (the constructor's), with `core` read from
/// OpenBLAS now.
Decision decision();
/// One phrase for a program's summary line, e.g. "OpenBLAS Haswell kernels (chosen from the
/// CPU's avx2 fma: OpenBLAS's own detection gave Prescott)", "OpenBLAS Cooperlake kernels
/// (its own choice)", "OpenBLAS Prescott kernels (OPENBLAS_CORETYPE=Prescott from the
/// environment; the CPU runs Haswell's: unset it for them)".
std::string summary();

/// Defined beside the constructor; read where BLAS is configured so that the constructor is
/// linked into every program that uses the kernels.
extern const int linked;

}  // namespace baton::blas
