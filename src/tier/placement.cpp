// placement.cpp: see placement.h.
#include "tier/placement.h"
