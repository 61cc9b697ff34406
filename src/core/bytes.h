// bytes.h: byte sizes as people write them ("24GiB", "1.5TB", "512 MiB", "5e8").
//
// Binary units (KiB, MiB, GiB, TiB, PiB) are powers of 1024; SI units (KB, MB, GB, TB, PB)
// are powers of 1000, as DeepSpeed and disk vendors use them. Units are case-insensitive
// except that a lone "b" would be ambiguous with bits, so only "B" is bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

// Throws Error naming the text when it is empty, negative, not a number, has an unknown
// unit, is not a whole number of bytes, or does not fit in 64 bits.
uint64_t parse_bytes(std::string_view text);
// "0 B", "512 B", "1.5 GiB", "24 GiB": the largest binary unit, at most two decimals.
std::string format_bytes(uint64_t bytes);

}  // namespace strata
