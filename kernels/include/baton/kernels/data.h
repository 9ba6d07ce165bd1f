#pragma once
/// Data sets and the source kernels that stream them as micro-batches (placeholder: being written).
