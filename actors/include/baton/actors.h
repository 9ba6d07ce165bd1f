#pragma once
/// baton/actors: plans, registers, the actor state machine, worker threads and the runtime.
#include "baton/actors/clock.h"
#include "baton/actors/ids.h"
#include "baton/actors/local_queue.h"
#include "baton/actors/mailbox.h"
#include "baton/actors/message.h"
#include "baton/actors/metrics.h"
#include "baton/actors/plan.h"
#include "baton/actors/plan_memory.h"
#include "baton/actors/runtime.h"
#include "baton/actors/settings.h"
#include "baton/actors/job.h"
