#!/usr/bin/env python3
"""check_layering.py fails on each kind of include it forbids and passes a clean tree."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_layering.py")


def run(files):
    with tempfile.TemporaryDirectory() as root:
        for path, text in files.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(text)
        p = subprocess.run([sys.executable, SCRIPT, root], capture_output=True, text=True)
        return p.returncode, p.stdout


class CheckLayeringTest(unittest.TestCase):
    def test_clean_tree_passes(self):
        code, out = run({"daemon/config/a.cc": '#include "daemon/common/b.h"\n',
                         "daemon/common/b.h": "\n"})
        self.assertEqual(code, 0, out)

    def test_common_including_config_fails(self):
        code, out = run({"daemon/common/a.cc": '#include "daemon/config/config.h"\n'})
        self.assertEqual(code, 1)
        self.assertIn("daemon/common/a.cc:1: includes daemon/config/config.h", out)

    def test_config_including_cuda_fails(self):
        code, out = run({"daemon/config/a.cc": '#include <x>\n#include "cuda/device.h"\n'})
        self.assertEqual(code, 1)
        self.assertIn("daemon/config/a.cc:2", out)

    def test_subscriber_including_publisher_fails(self):
        code, out = run({"daemon/subscriber/a.cc": '#include "daemon/publisher/trainer_api.h"\n'})
        self.assertEqual(code, 1)
        self.assertIn("subscriber may not depend on publisher", out)

    def test_prometheus_outside_metrics_fails(self):
        code, out = run({"daemon/serving/a.cc": '#include "prometheus/counter.h"\n'})
        self.assertEqual(code, 1)
        self.assertIn("only daemon/metrics uses prometheus-cpp", out)

    def test_core_including_a_concrete_store_or_file_format_fails(self):
        code, out = run({"daemon/subscriber/subscriber_core.cc":
                         '#include "daemon/store/shm_store.h"\n#include "daemon/model/safetensors.h"\n'})
        self.assertEqual(code, 1)
        self.assertEqual(out.count("a core knows the store interface"), 2, out)

    def test_services_naming_a_concrete_store_fail_and_the_daemon_may(self):
        code, out = run({"daemon/subscriber/consumer_api.cc": '#include "daemon/store/cuda_store.h"\n',
                         "daemon/subscriber/subscriber_daemon.cc":
                         '#include "daemon/store/shm_store.h"\n',
                         "daemon/subscriber/b.cc": '#include "daemon/store/tensor_store.h"\n'})
        self.assertEqual(code, 1)
        self.assertIn("daemon/subscriber/consumer_api.cc:1: includes daemon/store/cuda_store.h: "
                      "only a daemon's top level", out)
        self.assertNotIn("subscriber_daemon.cc", out)
        self.assertNotIn("b.cc", out)

    def test_services_may_use_the_metrics_interface_only(self):
        code, out = run({"daemon/serving/a.cc": '#include "daemon/metrics/refit_metrics.h"\n',
                         "daemon/serving/b.cc": '#include "daemon/metrics/daemon_metrics.h"\n'})
        self.assertEqual(code, 1)
        self.assertNotIn("serving/a.cc", out)
        self.assertIn("daemon/serving/b.cc:1", out)

    def test_daemons_including_a_file_format_fail(self):
        code, out = run({"daemon/publisher/a.cc": '#include "daemon/model/safetensors.h"\n',
                         "daemon/subscriber/b.cc": '#include "daemon/serving/version_file.h"\n',
                         "daemon/serving/version_file.h": '#include "daemon/common/x.h"\n',
                         "daemon/common/x.h": "\n"})
        self.assertEqual(code, 1)
        self.assertIn("daemon/publisher/a.cc:1: includes daemon/model/safetensors.h: publisher "
                      "may not depend on model", out)
        self.assertNotIn("subscriber/b.cc", out)

    def test_an_upward_include_through_an_allowed_header_fails(self):
        # serving may use sync; a sync header that includes a publisher header drags the
        # publisher into every serving file that includes it.
        files = {"daemon/serving/a.cc": '#include <vector>\n#include "daemon/sync/s.h"\n',
                 "daemon/sync/s.h": '#include "daemon/sync/t.h"\n',
                 "daemon/sync/t.h": '#include "daemon/publisher/trainer_api.h"\n',
                 "daemon/publisher/trainer_api.h": "\n"}
        code, out = run(files)
        self.assertEqual(code, 1)
        self.assertIn("daemon/serving/a.cc:2: includes daemon/sync/s.h, which reaches "
                      "daemon/publisher/trainer_api.h (through daemon/sync/s.h -> "
                      "daemon/sync/t.h -> daemon/publisher/trainer_api.h): serving may not "
                      "depend on publisher", out)
        # The sync header itself is reported for its own direct include.
        self.assertIn("daemon/sync/t.h:1: includes daemon/publisher/trainer_api.h", out)
        # Without the planted include the same tree passes.
        files["daemon/sync/t.h"] = '#include "daemon/common/c.h"\n'
        files["daemon/common/c.h"] = "\n"
        code, out = run(files)
        self.assertEqual(code, 0, out)

    def test_include_cycles_terminate(self):
        code, out = run({"daemon/serving/a.cc": '#include "daemon/sync/s.h"\n',
                         "daemon/sync/s.h": '#include "daemon/sync/t.h"\n',
                         "daemon/sync/t.h": '#include "daemon/sync/s.h"\n'})
        self.assertEqual(code, 0, out)


if __name__ == "__main__":
    unittest.main()
