// The reference for baton-bench-allreduce: MPI_Allreduce (float sum) back to back, as
// nccl-tests / OSU time it: after a warm-up and a barrier, each rank times the loop with
// MPI_Wtime; its time per all-reduce is that over the iterations, and the figure is the slowest
// rank's (MPI_Reduce with MPI_MAX), the statistic baton-bench-allreduce reports for its own
// ranks. Rank 0 prints one line per size: "SIZE_BYTES SECONDS_PER_OP".
//   mpirun -np N baton-mpi-allreduce-ref ITERS SIZE_BYTES...
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc < 3) {
    if (rank == 0) std::fprintf(stderr, "usage: baton-mpi-allreduce-ref ITERS SIZE_BYTES...\n");
    MPI_Finalize();
    return 2;
  }
  const long iters = std::atol(argv[1]);
  for (int a = 2; a < argc; ++a) {
    const long bytes = std::atol(argv[a]);
    const auto n = static_cast<std::size_t>(bytes / 4);
    std::vector<float> in(n, 1.0f), out(n, 0.0f);
    const long warm = iters < 5 ? 1 : iters / 5;
    for (long i = 0; i < warm; ++i) MPI_Allreduce(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (long i = 0; i < iters; ++i) MPI_Allreduce(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const double t = (MPI_Wtime() - t0) / static_cast<double>(iters);
    double worst = 0;
    MPI_Reduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) std::printf("%ld %.9f\n", bytes, worst);
    std::fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
