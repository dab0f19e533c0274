// refit_config_check [--print] FILE...: loads and validates each config file (every section it
// has) with every check refitd makes at start (daemon_config.h). Prints one line per file; with
// --print also the effective config (defaults filled). Exit 0 if all are valid, 1 if any is not,
// 2 on usage errors.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "daemon/common/arg_cursor.h"
#include "daemon/config/config.h"
#include "daemon/runtime/daemon_config.h"

int main(int argc, char** argv) {
  bool print = false;
  std::vector<std::string> files;
  refit::ArgCursor args(argc, argv);
  while (!args.Done()) {
    if (args.Help()) {
      std::printf("usage: %s [--print] FILE...\n", argv[0]);
      return 0;
    }
    if (args.Switch("--print")) {
      print = true;
      continue;
    }
    if (absl::StartsWith(args.Cur(), "-")) {
      const absl::Status st = refit::UnknownArgument(args.Cur(), "refit_config_check");
      std::fprintf(stderr, "%s: error: %s\n", argv[0], std::string(st.message()).c_str());
      return 2;
    }
    files.push_back(args.Cur());
    args.Next();
  }
  if (files.empty()) {
    std::fprintf(stderr, "%s: no config files given (usage: %s [--print] FILE...)\n", argv[0],
                 argv[0]);
    return 2;
  }
  int failed = 0;
  for (const std::string& file : files) {
    auto config = refit::runtime::LoadDaemonConfigFile(file);
    if (!config.ok()) {
      std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
      ++failed;
      continue;
    }
    std::printf("ok: %s (%s%s%s)\n", file.c_str(), config->has_publisher() ? "publisher" : "",
                config->has_publisher() && config->has_subscriber() ? ", " : "",
                config->has_subscriber() ? "subscriber" : "");
    if (print) {
      if (config->has_publisher()) {
        std::printf("%s", refit::config::ConfigToYaml(config->publisher()).c_str());
      }
      if (config->has_subscriber()) {
        std::printf("%s", refit::config::ConfigToYaml(config->subscriber()).c_str());
      }
    }
  }
  return failed == 0 ? 0 : 1;
}
