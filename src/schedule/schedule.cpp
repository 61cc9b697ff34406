// schedule.cpp: see schedule.h.
#include "schedule/schedule.h"
