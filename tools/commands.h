// commands.h: each `strata` subcommand registers itself on the CLI11 app here.
// A command's run function returns the process exit status; strata::Error escaping it is
// printed by main() as "strata: error: ..." with exit status 1.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace strata::cli {

using Run = std::function<int()>;
// Adds `strata info` to `app`; the returned function runs it once the arguments are parsed.
Run add_info(CLI::App& app);

}  // namespace strata::cli
