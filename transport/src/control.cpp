// Written by the control-plane work (in progress).
#include "baton/transport/control.h"
