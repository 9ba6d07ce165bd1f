#include "baton/kernels/data.h"
