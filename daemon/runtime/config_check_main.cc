// refit_config_check [--print] FILE...: loads and validates each config file (every section it
// has) with every check refitd makes at start (daemon_config.h). Prints one line per file; with
// --print also the effective config (defaults filled). Exit 0 if all are valid, 1 if any is not,
// 2 on usage errors.
#include <cstdio>
#include <string>
#include <vector>

#include "daemon/config/config.h"
#include "daemon/runtime/daemon_config.h"

int main(int argc, char** argv) {
  bool print = false;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--print") {
      print = true;
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: %s [--print] FILE...\n", argv[0]);
      return 0;
    } else if (!arg.empty() && arg[0] == '-') {
      std::fprintf(stderr, "%s: unknown option '%s' (usage: %s [--print] FILE...)\n", argv[0],
                   arg.c_str(), argv[0]);
      return 2;
    } else {
      files.push_back(arg);
    }
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
