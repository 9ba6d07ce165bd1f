#pragma once
/// baton/graph: the DSL, autodiff, optimizers and the compiler from a graph to a plan.
#include "baton/graph/autodiff.h"
#include "baton/graph/checkpoint.h"
#include "baton/graph/collectives.h"
#include "baton/graph/compile.h"
#include "baton/graph/graph.h"
#include "baton/graph/ops.h"
#include "baton/graph/profile.h"
#include "baton/graph/safetensors.h"
#include "baton/graph/sbp.h"
#include "baton/graph/schedule.h"
#include "baton/graph/sharding.h"
#include "baton/graph/vocab_parallel.h"
