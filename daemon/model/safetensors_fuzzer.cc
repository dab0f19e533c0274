// libFuzzer target for the safetensors reader (safetensors.h) on arbitrary file images.
//
// The input is the whole file image, parsed in memory (SafetensorsFile::FromBytes: the same
// Parse as Open, without a file). Any error is fine; a crash, a sanitizer report or a violated
// invariant (abort) is a finding. On a file that parses:
//   - every tensor lies inside the data region, has size = elements * dtype size, and the
//     tensors tile the data region in offset order;
//   - Find(name) returns the tensor's own index;
//   - writing the parsed tensors and metadata back (WriteSafetensors, to a tmpfs file) and
//     reading that gives the same names, dtypes, shapes, bytes and metadata.
// Build: cmake -DREFIT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ...; run: safetensors_fuzzer DIR
// (make_safetensors_corpus DIR writes seed files).
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/model/safetensors.h"

namespace {

using refit::model::SafetensorsEntry;
using refit::model::SafetensorsFile;
using refit::model::SafetensorsTensorRef;

void Check(bool ok) {
  if (!ok) abort();
}

// Layout invariants of a parsed file.
void CheckLayout(const SafetensorsFile& f) {
  const uint64_t data_begin = 8 + f.header_size();
  Check(data_begin <= f.file_size());
  std::vector<const SafetensorsEntry*> by_offset;
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const SafetensorsEntry& e = f.tensors()[i];
    Check(e.offset >= data_begin && e.size <= f.file_size() - e.offset);
    Check(e.size == e.num_elements() * refit::DTypeSize(e.dtype));
    Check(f.data(i).size() == e.size);
    auto found = f.Find(e.name);
    Check(found.ok() && *found == i);
    by_offset.push_back(&e);
  }
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
                     return a->offset < b->offset;
                   });
  uint64_t at = data_begin;
  for (const SafetensorsEntry* e : by_offset) {
    Check(e->offset == at);
    at += e->size;
  }
  Check(at == f.file_size());
}

// Write -> read gives the same file contents.
void CheckRoundTrip(const SafetensorsFile& f) {
  static const std::string path =
      absl::StrCat(access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", "/refit_st_fuzz_",
                   getpid(), ".safetensors");
  std::vector<SafetensorsTensorRef> refs;
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const SafetensorsEntry& e = f.tensors()[i];
    refs.push_back({e.name, e.dtype, e.shape, f.data(i)});
  }
  refit::SafeWriteOptions no_fsync;
  no_fsync.durable = false;
  absl::Cleanup remove = [] { unlink(path.c_str()); };  // nothing left in /dev/shm at exit
  absl::Status st = refit::model::WriteSafetensors(path, refs, f.metadata(), no_fsync);
  if (!st.ok()) {
    // Only the file system may refuse; what the reader accepted the writer must write.
    Check(!absl::IsInvalidArgument(st));
    return;
  }
  auto back = SafetensorsFile::Open(path);
  Check(back.ok());
  Check(back->tensors().size() == f.tensors().size());
  Check(back->metadata() == f.metadata());
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const SafetensorsEntry& a = f.tensors()[i];
    const SafetensorsEntry& b = back->tensors()[i];
    Check(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape);
    Check(std::equal(f.data(i).begin(), f.data(i).end(), back->data(i).begin(),
                     back->data(i).end()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = SafetensorsFile::FromBytes(std::vector<uint8_t>(data, data + size), "<fuzz>");
  if (!file.ok()) {
    Check(!file.status().message().empty());
    return 0;
  }
  CheckLayout(*file);
  CheckRoundTrip(*file);
  return 0;
}
