// FileStore: the rendezvous store in one file, for jobs whose ranks share a
// file system but cannot reach a master port.
//
// The file is an append-only log of records, [u8 type][u32 key length][key]
// [u32 value length][value] (little-endian): 'S' sets a key, 'D' deletes it,
// 'C' records how many stores have been destroyed (for num_workers cleanup).
// Every operation takes an exclusive flock, reads only the records appended
// since this process last looked, and appends its own; so each access costs
// the new bytes, not the whole file, and a record is never seen half-written.
// Waiting polls the file, since inotify does not see writes made on other
// NFS clients.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/exception.h"
#include "distributed/store/store.h"
#include "distributed/store/store_internal.h"

namespace ember::distributed {
namespace {

using detail::Clock;
using detail::deadline_after;
using detail::quote_key;
using detail::quote_keys;
using detail::remaining;

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

bool parse_int(const std::string& s, int64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

}  // namespace

struct FileStore::Impl {
  std::string path;
  int num_workers = -1;
  int fd = -1;
  std::mutex mu;  // threads of one process share fd, and flock is per open file
  off_t pos = 0;  // bytes of the log already applied to `data`
  std::unordered_map<std::string, std::string> data;
  int64_t destroyed = 0;

  std::string where() const { return "FileStore " + path; }

  // Holds the thread mutex and the file lock for one operation, with the
  // cache brought up to date.
  class Locked {
   public:
    explicit Locked(Impl& s) : s_(s), lock_(s.mu) {
      while (flock(s_.fd, LOCK_EX) != 0) {
        if (errno != EINTR) throw Error(s_.where() + ": cannot lock the file: " + std::strerror(errno));
      }
      try {
        s_.sync();
      } catch (...) {
        flock(s_.fd, LOCK_UN);
        throw;
      }
    }
    ~Locked() { flock(s_.fd, LOCK_UN); }

   private:
    Impl& s_;
    std::lock_guard<std::mutex> lock_;
  };

  void sync() {
    struct stat st;
    if (fstat(fd, &st) != 0) throw Error(where() + ": cannot stat the file: " + std::strerror(errno));
    if (st.st_size < pos) {
      // Someone truncated the file (a fresh run reusing the path): start over.
      data.clear();
      destroyed = 0;
      pos = 0;
    }
    if (st.st_size == pos) return;
    std::string buf(static_cast<size_t>(st.st_size - pos), '\0');
    size_t got = 0;
    while (got < buf.size()) {
      ssize_t r = pread(fd, buf.data() + got, buf.size() - got, pos + static_cast<off_t>(got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw Error(where() + ": cannot read the file: " + (r < 0 ? std::strerror(errno) : "short read"));
      got += static_cast<size_t>(r);
    }
    size_t i = 0;
    while (i < buf.size()) {
      size_t start = i;
      auto corrupt = [&] {
        return Error(where() + ": corrupt record at byte " + std::to_string(pos + static_cast<off_t>(start)) +
                     " (a process died while writing, or the file is not a FileStore); delete the file and restart");
      };
      if (buf.size() - i < 9) throw corrupt();
      char type = buf[i];
      uint32_t klen = get_u32(&buf[i + 1]);
      i += 5;
      if (buf.size() - i < klen + size_t{4}) throw corrupt();
      std::string key = buf.substr(i, klen);
      i += klen;
      uint32_t vlen = get_u32(&buf[i]);
      i += 4;
      if (buf.size() - i < vlen) throw corrupt();
      std::string value = buf.substr(i, vlen);
      i += vlen;
      if (type == 'S') {
        data[std::move(key)] = std::move(value);
      } else if (type == 'D') {
        data.erase(key);
      } else if (type == 'C') {
        if (!parse_int(value, &destroyed)) throw corrupt();
      } else {
        throw corrupt();
      }
    }
    pos = st.st_size;
  }

  // Call with the lock held and the cache synced.
  void append(char type, const std::string& key, const std::string& value) {
    std::string rec(1, type);
    put_u32(rec, static_cast<uint32_t>(key.size()));
    rec += key;
    put_u32(rec, static_cast<uint32_t>(value.size()));
    rec += value;
    size_t done = 0;
    while (done < rec.size()) {
      ssize_t w = write(fd, rec.data() + done, rec.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error(where() + ": cannot write the file: " + std::strerror(errno));
      done += static_cast<size_t>(w);
    }
    pos += static_cast<off_t>(rec.size());
    if (type == 'S') data[key] = value;
    if (type == 'D') data.erase(key);
  }

  bool has_all(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data.count(k) > 0; });
  }

  // Polls until `ready` (run under the lock) returns true or the deadline
  // passes; backs off so idle waiters do not hammer a shared file system.
  template <typename F>
  bool poll_until(Millis timeout, F&& ready) {
    auto deadline = deadline_after(timeout);
    Millis backoff{1};
    for (;;) {
      {
        Locked l(*this);
        if (ready()) return true;
      }
      Millis left = remaining(deadline);
      if (left <= Millis{0}) return false;
      std::this_thread::sleep_for(std::min(backoff, left));
      backoff = std::min(backoff * 2, Millis{50});
    }
  }
};

FileStore::FileStore(std::string path, int num_workers, Millis timeout)
    : Store(timeout), impl_(std::make_unique<Impl>()) {
  EMBER_CHECK(!path.empty(), "FileStore: empty path");
  EMBER_CHECK(timeout > Millis{0}, "FileStore ", path, ": timeout must be positive, got ", timeout.count(), " ms");
  impl_->path = std::move(path);
  impl_->num_workers = num_workers;
  impl_->fd = open(impl_->path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  EMBER_CHECK(impl_->fd >= 0, "FileStore: cannot open ", impl_->path, ": ", std::strerror(errno));
}

// With num_workers set, the last of them to go removes the file, so the next
// job starting on the same path does not read this one's keys.
FileStore::~FileStore() {
  if (impl_->fd < 0) return;
  if (impl_->num_workers > 0) {
    try {
      Impl::Locked l(*impl_);
      int64_t n = impl_->destroyed + 1;
      impl_->append('C', "", std::to_string(n));
      if (n >= impl_->num_workers) unlink(impl_->path.c_str());
    } catch (const std::exception&) {
      // A destructor cannot report; the file merely stays behind.
    }
  }
  ::close(impl_->fd);
}

void FileStore::set(const std::string& key, const Bytes& value) {
  Impl::Locked l(*impl_);
  impl_->append('S', key, std::string(value.begin(), value.end()));
}

Bytes FileStore::get(const std::string& key) {
  std::string value;
  bool found = impl_->poll_until(timeout_, [&] {
    auto it = impl_->data.find(key);
    if (it == impl_->data.end()) return false;
    value = it->second;
    return true;
  });
  EMBER_CHECK(found, impl_->where(), ": get(", quote_key(key), ") timed out after ", timeout_.count(),
              " ms: no process set key ", quote_key(key));
  return Bytes(value.begin(), value.end());
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  Impl::Locked l(*impl_);
  int64_t current = 0;
  auto it = impl_->data.find(key);
  EMBER_CHECK(it == impl_->data.end() || parse_int(it->second, &current), impl_->where(), ": add(", quote_key(key),
              ", ", delta, "): the value stored at ", quote_key(key), " is not an integer: ", quote_key(it->second));
  int64_t result = current + delta;
  impl_->append('S', key, std::to_string(result));
  return result;
}

Bytes FileStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Impl::Locked l(*impl_);
  std::string exp(expected.begin(), expected.end());
  auto it = impl_->data.find(key);
  bool matches = it == impl_->data.end() ? exp.empty() : it->second == exp;
  if (matches) impl_->append('S', key, std::string(desired.begin(), desired.end()));
  it = impl_->data.find(key);
  return it == impl_->data.end() ? Bytes{} : Bytes(it->second.begin(), it->second.end());
}

bool FileStore::check(const std::vector<std::string>& keys) {
  Impl::Locked l(*impl_);
  return impl_->has_all(keys);
}

void FileStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> missing;
  bool ok = impl_->poll_until(timeout, [&] {
    missing.clear();
    for (const auto& k : keys)
      if (!impl_->data.count(k)) missing.push_back(k);
    return missing.empty();
  });
  EMBER_CHECK(ok, impl_->where(), ": wait(", quote_keys(keys), ") timed out after ", timeout.count(),
              " ms; still missing: ", quote_keys(missing));
}

bool FileStore::delete_key(const std::string& key) {
  Impl::Locked l(*impl_);
  if (!impl_->data.count(key)) return false;
  impl_->append('D', key, "");
  return true;
}

int64_t FileStore::num_keys() {
  Impl::Locked l(*impl_);
  return static_cast<int64_t>(impl_->data.size());
}

}  // namespace ember::distributed
