// simulator.cpp: see simulator.h.
#include "schedule/simulator.h"
