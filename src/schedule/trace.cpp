// trace.cpp: see trace.h.
#include "schedule/trace.h"
