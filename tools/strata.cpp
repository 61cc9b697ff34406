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

  std::vector<std::pair<CLI::App*, strata::cli::Run>> commands;
  auto add = [&](strata::cli::Run (*adder)(CLI::App&)) {
    const size_t before = app.get_subcommands({}).size();
    strata::cli::Run run = adder(app);
    commands.emplace_back(app.get_subcommands({})[before], std::move(run));
  };
  add(strata::cli::add_info);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (!level.empty()) strata::set_log_level(strata::parse_log_level(level));
    for (auto& [sub, run] : commands)
      if (sub->parsed()) return run();
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
