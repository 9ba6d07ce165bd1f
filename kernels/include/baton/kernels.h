#pragma once
/// baton/kernels: tensors, dtypes, devices, allocators and the kernel registry.
#include "baton/kernels/allocator.h"
#include "baton/kernels/attrs.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/device.h"
#include "baton/kernels/dtype.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/nccl.h"
#include "baton/kernels/ops.h"
#include "baton/kernels/sim.h"
#include "baton/kernels/store.h"
#include "baton/kernels/stream.h"
#include "baton/kernels/tensor.h"
