// The TCPStore wire protocol, shared by the client (tcp_store.cc) and the
// server (tcp_store_server.cc); see tcp_store.cc for the format and the
// security and liveness rules. Internal: not part of the public interface.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/store/store.h"
#include "distributed/store/store_internal.h"

namespace ember::distributed::wire {

using detail::Clock;
using detail::deadline_after;
using detail::quote_key;
using detail::quote_keys;
using detail::remaining;

constexpr char kMagic[8] = {'E', 'M', 'B', 'R', 'S', 'T', 'O', '1'};
// How long a listener on the store's port may take to answer the handshake.
constexpr Millis kHandshakeReply{5000};
// Rendezvous payloads are addresses and ids; a frame this large is a bug or
// garbage, and refusing it keeps a bad client from exhausting the server.
constexpr uint32_t kMaxFrame = 1u << 30;
// The server answers a blocking request at its deadline; the client waits
// this much longer before concluding that the server itself is gone.
constexpr Millis kReplyGrace{5000};

// LostSince: the ranks lost within a window, those a replacement has taken
// over since included (Store::lost_ranks_since).
enum class Cmd : uint8_t {
  Set = 1,
  Get,
  Add,
  CompareSet,
  Check,
  Wait,
  Delete,
  NumKeys,
  WaitWorkers,
  Hello,
  Bye,
  Lost,
  LostSince
};
enum class Status : uint8_t { Ok = 0, Timeout = 1, Error = 2, RankLost = 3 };
// A token is a short secret; a longer first frame is not one of our clients.
constexpr uint32_t kMaxToken = 4096;

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string errno_text(int err) { return std::strerror(err); }

// Builds one frame; the length prefix is patched in by finish().
class Writer {
 public:
  Writer() : buf_(4, '\0') {}
  Writer& u8(uint8_t v) {
    buf_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& i64(int64_t v) {
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& bytes(const void* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  Writer& str(std::string_view s) { return bytes(s.data(), s.size()); }
  std::string finish() {
    uint32_t n = static_cast<uint32_t>(buf_.size() - 4);
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return std::move(buf_);
  }
  size_t size() const { return buf_.size() - 4; }

 private:
  std::string buf_;
};

inline uint32_t load_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(s_[pos_++]);
  }
  uint32_t u32() {
    need(4);
    uint32_t v = load_u32(s_.data() + pos_);
    pos_ += 4;
    return v;
  }
  int64_t i64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<unsigned char>(s_[pos_ + i])} << (8 * i);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  std::string str() {
    uint32_t n = u32();
    need(n);
    std::string out(s_.substr(pos_, n));
    pos_ += n;
    return out;
  }
  std::vector<std::string> strs() {
    const uint32_t n = count(4);  // each key costs at least its 4-byte length
    std::vector<std::string> out;
    out.reserve(n);
    for (uint32_t i = 0; i < n; ++i) out.push_back(str());
    return out;
  }
  // A count of records of at least `min_bytes` each, checked against what
  // the frame holds before anything is allocated for them.
  uint32_t count(size_t min_bytes) {
    uint32_t n = u32();
    if (n > (s_.size() - pos_) / min_bytes) throw ProtocolError("record count exceeds the frame");
    return n;
  }
  bool at_end() const { return pos_ == s_.size(); }
  void done() const {
    if (pos_ != s_.size()) throw ProtocolError("trailing bytes in frame");
  }

 private:
  void need(size_t n) const {
    if (s_.size() - pos_ < n) throw ProtocolError("truncated frame");
  }
  std::string_view s_;
  size_t pos_ = 0;
};

inline void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Values are decimal text so that get() of a counter reads like c10d's.
inline bool parse_int(const std::string& s, int64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

// The server thread rank 0 runs (tcp_store_server.cc): listens on `host`'s
// addresses (every interface with listen_on_all) at `port` (0: a free one)
// and serves until destroyed.
class Server {
 public:
  virtual ~Server() = default;
  virtual int port() const = 0;
};
std::unique_ptr<Server> start_server(const std::string& host, int port, bool listen_on_all, std::string token);

}  // namespace ember::distributed::wire
