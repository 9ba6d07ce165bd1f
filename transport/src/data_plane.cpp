// Written by the data-plane work (in progress).
#include "baton/transport/data_plane.h"
