#!/usr/bin/env python3
"""run.py's trajectory cache (used by the WAN benchmark and the demo): a directory is reused only
when it is this generator's (fingerprint of the generator's sources) and validates; a stale or
damaged one is removed and regenerated; a longer one serves a shorter request.

    trajectory_cache_test.py BUILD_DIR
"""
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

BUILD = None


class TrajectoryCacheTest(unittest.TestCase):
    def setUp(self):
        self.cache = tempfile.mkdtemp(prefix="traj-cache-test-")
        self.bins = {"make_trajectory": os.path.join(BUILD, "bench/wan/make_trajectory")}
        run.log = lambda msg: None

    def tearDown(self):
        shutil.rmtree(self.cache, ignore_errors=True)

    def generate(self, versions=2):
        return run.trajectory(self.bins, self.cache, "tiny", 1, versions)

    def test_reused_when_valid(self):
        d = self.generate()
        mtime = os.stat(run.version_file(d, 2)).st_mtime_ns
        self.assertEqual(self.generate(), d)
        self.assertEqual(os.stat(run.version_file(d, 2)).st_mtime_ns, mtime)
        self.assertTrue(os.path.basename(d).endswith("-g" + run.generator_fingerprint(self.bins)))

    def test_other_generator_removed(self):
        stale = os.path.join(self.cache, "tiny-s1-n2-g000000000000")
        shutil.copytree(self.generate(), stale)
        self.assertNotEqual(self.generate(), stale)
        self.assertFalse(os.path.exists(stale))

    def test_truncated_file_regenerated(self):
        d = self.generate()
        with open(run.version_file(d, 2), "r+b") as f:
            f.truncate(1000)
        self.assertFalse(run.trajectory_valid(d, "tiny", 1, 2))
        self.assertEqual(self.generate(), d)
        self.assertTrue(run.trajectory_valid(d, "tiny", 1, 2))

    def test_missing_complete_marker_regenerated(self):
        d = self.generate()
        os.remove(os.path.join(d, "complete.json"))
        self.assertEqual(self.generate(), d)
        self.assertTrue(os.path.exists(os.path.join(d, "complete.json")))

    def test_longer_serves_shorter_and_preset_checked(self):
        d = self.generate(versions=2)
        self.assertEqual(self.generate(versions=1), d)
        self.assertFalse(run.trajectory_valid(d, "medium", 1, 2))
        self.assertFalse(run.trajectory_valid(d, "tiny", 2, 2))
        self.assertFalse(run.trajectory_valid(d, "tiny", 1, 3))

    def test_no_partial_directory_left(self):
        self.generate()
        self.assertEqual([n for n in os.listdir(self.cache) if n.startswith(".")], [])


if __name__ == "__main__":
    BUILD = sys.argv.pop(1)
    unittest.main()
