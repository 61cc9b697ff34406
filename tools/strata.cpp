// strata.cpp: the command line. Parses arguments with CLI11 and runs one subcommand;
// the only place where a strata::Error becomes an exit status.
#include "commands.h"
#include "core/error.h"
#include "core/log.h"

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  CLI::App app{"strata: train language models whose state does not fit on the GPU"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "strata 0.1.0");
  std::string level;
  app.add_option("--log", level, "log level: error, warn, info, debug, trace (or STRATA_LOG)");

  const std::vector<strata::cli::Command> commands = {
      strata::cli::add_info(app),     strata::cli::add_eval(app),  strata::cli::add_bench(app),
      strata::cli::add_estimate(app), strata::cli::add_plan(app),  strata::cli::add_tokenize(app),
      strata::cli::add_generate(app), strata::cli::add_train(app), strata::cli::add_export(app),
      strata::cli::add_tune(app),
  };

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (!level.empty()) strata::set_log_level(strata::parse_log_level(level));
    for (const strata::cli::Command& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
