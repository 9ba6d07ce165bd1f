// The transfers pass (passes.h): a transfer actor wherever a register crosses ranks.
#include "baton/graph/passes.h"

namespace baton::passes {

Plan transfers(const Plan& plan) {
  return insert_transfers(plan);
}

}  // namespace baton::passes
