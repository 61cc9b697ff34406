// bench.cpp: `strata bench <what>`. Every benchmark verifies its output before it reports a
// speed, and measures its peer or bound in the same run (see each bench_*.cpp).
#include "commands.h"

#include <vector>

namespace strata::cli {

Command add_bench(CLI::App& app) {
  CLI::App* bench = app.add_subcommand(
      "bench", "measure a part of strata against its peer or bound, after verifying its output");
  bench->require_subcommand(1);
  std::vector<Command> subs = {
      // one line per benchmark: add_bench_<what>(*bench),
      add_bench_adam(*bench),  add_bench_attention(*bench), add_bench_io(*bench),
      add_bench_model(*bench), add_bench_ops(*bench),       add_bench_step(*bench),
  };
  return {bench, [subs] {
            for (const Command& c : subs)
              if (c.app->parsed()) return c.run();
            return 0;
          }};
}

}  // namespace strata::cli
