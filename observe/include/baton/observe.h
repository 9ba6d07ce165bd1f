#pragma once
/// baton/observe: watching a job. The collector (one per rank), the job model (all ranks),
/// the dashboard's HTTP server and /metrics.
#include "baton/observe/collector.h"
#include "baton/observe/dashboard.h"
#include "baton/observe/job_model.h"
#include "baton/observe/telemetry.h"
#include "baton/observe/watch.h"
