#pragma once
/// Collectives made of actors: plan fragments any compiler (or hand-written plan) can add.
///
/// All-reduce over N members as a ring (Patarasuk & Yuan 2009; Horovod, NCCL): the tensor of n
/// elements is cut into N chunks, chunk c into S segments (allreduce_segments()). For each
/// (chunk, segment) the reduce-scatter is a chain of N-1 add actors hopping around the ring
/// from member c+1 to member c: the actor on member c+k adds its member's own segment, read in
/// place out of the member's input register, to the partial sum it received from member
/// c+k-1. Only the segment travels: where the chain's first hop crosses ranks, the next member
/// pulls the segment's window of member c+1's input straight from its slot (a transfer of a
/// window, ActorDesc::window); on the same rank the first add reads it in place. A hop from
/// another rank is one reducing transfer that adds as it receives
/// (AllReduceSettings::fuse_receive_add), and its first reads the segment's window of member
/// c+1's input where it lies. Compressed sums, and inputs in parts whose segment spans two
/// registers, copy the segment out first (a slice actor). The S segments of a chunk pipeline:
/// segment s+1 is sent while segment s is being added one hop further on.
///
/// All-gather: member c's finished sum of each of its segments goes straight to every other
/// member (N-1 transfers that pull it concurrently), not around the ring. Each member sends
/// and receives the same (N-1)/N of the tensor either way; the direct form has one hop of
/// latency instead of N-1 and needs no relay actor (a relay on this transport is a second
/// copy: a transfer writes only its own register). Chosen on that reasoning; a ring
/// all-gather has not been built to measure against it. Each member's gather is one transfer
/// that pulls each remote sum straight into its place in the result (a gathering transfer) and
/// copies those of its own rank there; members on a CUDA device, compressed sums (widened to
/// f32 there) and results of sums all on the member's own rank copy the N*S sums into the
/// result with a concat actor instead.
///
/// Every member ends with the same bits: each element's sum is made once, by one chain, in
/// the chain's fixed order (member c+1, c+2, ..., c). Members on other ranks are reached
/// through transfer actors (insert_transfers: UCX tagged send / receive, shared memory or CMA
/// between the processes of one host), members on other in-process devices read each
/// other's registers in place. Kernels: allreduce.slice / .add / .concat (f32, f64, on the CPU
/// and CUDA devices; add_collective_kernels; on the CPU the f32 ones also read and write bf16
/// sums, AllReduceSettings::wire).
///
///   auto results = baton::add_allreduce(plan, "grad", members, {1 << 20}, baton::f32);
///   auto fine = baton::add_allreduce(plan, "g2", members, {1 << 20}, baton::f32, 2,
///                                    {.segment_bytes = 64 << 10});
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "baton/actors/plan.h"
#include "baton/kernels/kernel.h"

namespace baton {

struct AllReduceMember {
  Placement where;       // where its slice, add and gather actors run
  RegisterIndex input;   // its register to sum (one piece per act)
  std::string suffix;    // appended to the names of its actors and registers (e.g. "@dp1")
  /// For add_reduce_scatter only, on CPU members, without compression: the input is instead
  /// the concatenation of these registers (a gradient bucket's weights' gradients, where they
  /// lie: no packed copy). Each actor reads only the parts its elements are in. Every member's
  /// parts have the same sizes.
  std::vector<RegisterIndex> parts = {};
};

/// The registers of `parts` (a tensor in parts, concatenated in order) that hold elements
/// [offset, offset + count) of it, and where that window starts in their concatenation. Empty
/// parts hold nothing and are left out.
std::pair<std::vector<RegisterIndex>, std::int64_t> window_of_parts(const Plan& plan,
                                                                   const std::vector<RegisterIndex>& parts,
                                                                   std::int64_t offset, std::int64_t count);

/// How the sums are made and travel.
enum class AllReduceAlgorithm : std::uint8_t {
  /// Reduce-scatter chains of adds around the ring, segmented and pipelined (above).
  ring,
  /// The earlier form, kept to compare against (baton-bench-allreduce --algorithm two_hop):
  /// each member's split actor copies out its N chunks, the owner of chunk c sums chunk c of
  /// every member in one act, every member's gather copies the N sums. Two hops whatever N,
  /// whole chunks, no segments.
  two_hop,
  /// Latency first, for small tensors: every member's sum actor reads every member's whole
  /// input (members on other ranks through one transfer each) and adds them in member order,
  /// so every member makes the same sum, bit for bit, one hop after the inputs are ready. Each
  /// member receives (N-1) whole tensors instead of the ring's 2(N-1)/N: cheap only while the
  /// tensor is small (AllReduceSettings::direct_below_bytes).
  direct,
};

/// Below this many bytes a gradient bucket is all-reduced `direct`, above it by the ring, where
/// the job's ranks span hosts: the crossover measured with baton-bench-allreduce through the
/// data plane (README, "Numbers"; UCX's rendezvous from 16 KiB made direct lose there).
inline constexpr std::int64_t gradient_direct_below_bytes = std::int64_t{8} << 10;
/// The same where every rank is on one host (TrainConfig::rank_hosts), whose ranks read one
/// another's pieces in place: measured with pieces read in place and the ring adding as it
/// receives (README), direct won at every size to 64 KiB on 2 and 4 ranks but for 4 KiB on 2,
/// the runs split at 128 KiB, and the ring won from 256 KiB on 4 ranks.
inline constexpr std::int64_t gradient_direct_below_bytes_one_host = std::int64_t{128} << 10;

/// How add_allreduce cuts the tensor. Defaults measured with baton-bench-allreduce (README).
struct AllReduceSettings {
  AllReduceAlgorithm algorithm = AllReduceAlgorithm::ring;
  /// With the ring: a tensor of fewer bytes than this is all-reduced `direct` instead (0: never,
  /// so that asking for the ring gets the ring). As NCCL and Open MPI's tuned module choose by
  /// size, the gradient buckets of compile_training use gradient_direct_below_bytes.
  std::int64_t direct_below_bytes = 0;
  /// Target bytes of one segment: each chunk is cut into ceil(chunk bytes / segment_bytes)
  /// segments, so a tensor below N x segment_bytes has one segment per chunk (the fewest
  /// actors) and larger ones pipeline.
  std::int64_t segment_bytes = std::int64_t{1} << 20;
  /// At most this many segments per chunk: bounds the actors of a very large tensor (each
  /// segment costs N-1 adds, a slice and their transfers); the segments then grow instead.
  std::int64_t max_segments = 16;
  /// Slots of every partial and sum register: how many segments may be in flight on one hop.
  std::int32_t slots = 2;
  /// A hop whose partial sum comes from another rank is one reducing transfer (ActorKind::
  /// transfer, op "transfer.add"): the member adds its own segment to the partial as it reads
  /// it, in the previous member's slot between ranks of one host (or as it arrives inline),
  /// instead of a transfer copying the partial into a register of its own and an add reading
  /// that copy: one pass over the partial instead of two, and one actor per hop (Horovod's and
  /// NCCL's rings receive and reduce in one step too). The first hop reads the segment's window
  /// of the first member's input, so no slice and no window transfer either. Members on the
  /// CPU, uncompressed sums, inputs in one register; others keep the transfer and the add. The
  /// same additions in the same order: the same bits. The direct form between two CPU members
  /// on two ranks (f32, f64) likewise: each member's sum is one reducing transfer reading the
  /// other's input (since 2026-11-27; with more members the sum actor reads copies). False: the
  /// transfer, then the add (the form before late 2026-11-27, kept to measure:
  /// baton-bench-allreduce --unfused).
  bool fuse_receive_add = true;
  /// Gradient compression on the wire (Horovod's fp16 compression, in f16 or bf16): the dtype
  /// the partial and finished sums are stored in and travel in; unset, the tensor's. Only bf16
  /// or f16 for f32 members on the CPU, ring only: each hop adds its member's f32 segment to the
  /// received partial in f32 and rounds once to the wire dtype to send it on (the chain's first
  /// partial is rounded when it is sliced out), and each member's gather widens the sums back to
  /// f32. Half the bytes on every hop; every member still ends with the same bits. A finite sum
  /// beyond f16's range (65504) fails the act that rounds it, naming it.
  std::optional<DType> wire;
  /// Where the job's ranks are: rank_hosts[r] is the host of rank r (any numbering; empty: not
  /// known, as if all on one host). Where the members span two hosts or more, with the same
  /// number of members (two or more) on each, add_allreduce is hierarchical (Horovod's, in the
  /// 2D form NCCL's trees and Horovod's hierarchical all-reduce share): each host's members
  /// reduce-scatter among themselves (the ring above, over shared memory), member j of every
  /// host all-reduces its host's chunk j with member j of the other hosts (a ring across hosts,
  /// one per local index, so every member's link is busy and each carries 1/L of the tensor),
  /// and each member gathers its host's chunks. Across hosts each member sends 2(H-1)/H of
  /// n/L elements instead of the flat ring's 2(N-1)/N of n, in H-1 hops instead of N-1.
  /// Not with `wire` (compressed sums stay on the flat ring: the hop across hosts would add
  /// bf16 partials, which no kernel does), nor below direct_below_bytes (one hop already);
  /// add_reduce_scatter (ZeRO's) stays flat. baton-launch numbers ranks host by host
  /// (JobEnvironment::rank_hosts).
  std::vector<std::uint32_t> rank_hosts = {};
};

/// Adds the all-reduce of the members' inputs (each of `shape` and `dtype`) under `name`;
/// returns the members' result registers (`result_slots` each), in member order.
std::vector<RegisterIndex> add_allreduce(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                         const Shape& shape, DType dtype, std::int32_t result_slots = 2,
                                         const AllReduceSettings& settings = {});

/// The members of a hierarchical all-reduce grouped by host (member indices; each host's in
/// member order, the hosts in the order of their first member), or empty where add_allreduce
/// stays flat for these members, tensor and settings (AllReduceSettings::rank_hosts). Throws
/// std::invalid_argument if a member's rank has no host in rank_hosts.
std::vector<std::vector<std::size_t>> hosts_of_members(const std::vector<AllReduceMember>& members, const Shape& shape,
                                                       DType dtype, const AllReduceSettings& settings);

/// A hierarchical all-reduce without its gathers (hosts_of_members() must not be empty):
/// sums[m] are registers on member m's host (on member m's own rank for its own chunk, on its
/// host's other members' for theirs) whose concatenation, in order, is the whole sum; every
/// member's are the same bits. Inputs may be in parts (AllReduceMember::parts), as for
/// add_reduce_scatter. Registers have `settings.slots`.
std::vector<std::vector<RegisterIndex>> add_host_sums(Plan& plan, const std::string& name,
                                                      const std::vector<AllReduceMember>& members, const Shape& shape,
                                                      DType dtype, const AllReduceSettings& settings);

/// What add_reduce_scatter leaves on each member: its chunk of the sum.
struct ReduceScattered {
  /// Where member c's chunk starts in the tensor (members + 1 offsets: chunk_offsets()).
  std::vector<std::int64_t> offsets;
  /// parts[c]: registers on member c whose concatenation, in order, is elements [offsets[c],
  /// offsets[c + 1]) of the sum (one per segment of the ring; one with direct and two_hop),
  /// in the wire dtype (AllReduceSettings::wire) when the sums are compressed.
  std::vector<std::vector<RegisterIndex>> parts;
};

/// The first half of add_allreduce: member c ends with chunk c of the sum and nothing else (no
/// gather), as ZeRO's sharded optimizers want it. The same chains, so the same bits as the
/// flat all-reduce's result at those elements, by the same algorithm (rank_hosts is not read); direct here means member c
/// sums chunk c of every member's input, in member order. Registers have `settings.slots`.
ReduceScattered add_reduce_scatter(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                   const Shape& shape, DType dtype, const AllReduceSettings& settings = {});

/// The collectives add_nccl_collective can add (kernels "nccl.allreduce", "nccl.reduce_scatter",
/// "nccl.all_gather"; baton/kernels/nccl.h).
enum class NcclCollective : std::uint8_t { all_reduce, reduce_scatter, all_gather };

/// The all-reduce of the members' inputs through NCCL instead of actors: one actor per member,
/// on the member's placement (a CUDA device; rank, device and stream), reading the member's
/// input register and writing its result register (`result_slots`; named
/// "<name>.allreduced<suffix>" as add_allreduce's are). The actors share the NCCL communicator
/// `group` (default: `name`), made the first time they act from a unique id that the group's
/// lowest rank publishes through the job's control plane; the result is NCCL's sum, the same
/// bits on every member. Members must be on distinct (rank, CUDA device) pairs.
///
/// NCCL matches the calls of a communicator in the order each rank makes them, and a stream
/// runs its work in order: NCCL actors that share a communicator or a stream must act in the
/// same order on every rank (give them an ActOrder lane, or each group a stream of its own),
/// else two ranks can wait on each other until NCCL's watchdog fails the run (3/4 of the
/// runtime's stall timeout; baton/kernels/nccl.h). The first act of
/// each member waits for the whole group's first act (the communicator's set-up).
///
///   auto sums = baton::add_nccl_allreduce(plan, "grad", {{{0, Device::parse("cuda:0")}, g0, "@dp0"},
///                                                       {{1, Device::parse("cuda:0")}, g1, "@dp1"}},
///                                         {1 << 20}, baton::f32);
std::vector<RegisterIndex> add_nccl_allreduce(Plan& plan, const std::string& name,
                                              const std::vector<AllReduceMember>& members, const Shape& shape,
                                              DType dtype, std::int32_t result_slots = 2, const std::string& group = {});

/// add_nccl_allreduce for any of the three collectives. `shape` is the shape of each member's
/// input; the results are: all_reduce `shape`; reduce_scatter {numel / members} (member i gets
/// elements [i x that, (i + 1) x that) of the sum; numel must divide evenly); all_gather
/// {members x numel} (every member's input in member order). Result registers are named
/// "<name>.allreduced", ".reduce_scattered" or ".all_gathered" + suffix.
std::vector<RegisterIndex> add_nccl_collective(Plan& plan, NcclCollective collective, const std::string& name,
                                               const std::vector<AllReduceMember>& members, const Shape& shape,
                                               DType dtype, std::int32_t result_slots = 2,
                                               const std::string& group = {});

/// Segments per chunk that add_allreduce uses for `elements` of `dtype` over `members`:
/// ceil(largest chunk's bytes / segment_bytes), at least 1, at most max_segments, at most the
/// largest chunk's elements and at most 240 / members (each member's input is read by members
/// x segments actors; a register has at most 255 readers).
std::int64_t allreduce_segments(std::int64_t elements, DType dtype, std::int64_t members,
                                const AllReduceSettings& settings = {});

/// The kernels add_allreduce's actors name.
void add_collective_kernels(KernelRegistry& kernels);

/// Where chunk c of n elements over `parts` members starts (parts + 1 offsets).
std::vector<std::int64_t> chunk_offsets(std::int64_t n, std::int64_t parts);

}  // namespace baton
