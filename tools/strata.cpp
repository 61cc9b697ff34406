// strata.cpp: the command line. Parses arguments with CLI11 and runs one subcommand;
// the only place where a strata::Error becomes an exit status.
#include "commands.h"
#include "core/error.h"
#include "core/log.h"

#include <cstdio>
#include <string>
#include <vector>

namespace {

// Hugging Face's scripts spell their flags with underscores (--learning_rate), which its argument
// parser accepts beside the dashed form; strata's flags are dashed, so an underscore in a flag's
// name (before any "=") becomes a dash. Nothing after a bare "--" is touched.
std::vector<std::string> dashed_flags(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (a.size() < 3 || a[0] != '-' || a[1] != '-') continue;
    for (size_t c = 2; c < a.size() && a[c] != '='; ++c)
      if (a[c] == '_') a[c] = '-';
  }
  return args;
}

}  // namespace

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

  std::vector<std::string> args = dashed_flags(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  try {
    app.parse(argc, arg_ptrs.data());
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
