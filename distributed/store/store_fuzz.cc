// Fuzz target: the TCPStore wire protocol, both ends. The first input byte
// picks the side:
//   even: the rest is sent to a live server (job token "fuzz"): as a
//         client's frames after a proper handshake when the byte is a
//         multiple of 4, else as the opening itself; the server must keep
//         serving (a well-behaved client checks afterwards);
//   odd:  a fake server completes the handshake and answers a client's get()
//         with the rest; the client must throw ember::Error (never another
//         exception type, never crash) or return a value.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/exception.h"
#include "distributed/store/store.h"

namespace {

using namespace ember;
using namespace ember::distributed;
using namespace std::chrono_literals;

constexpr char kMagic[8] = {'E', 'M', 'B', 'R', 'S', 'T', 'O', '1'};
const std::string kToken = "fuzz";

void require(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "store_fuzz: invariant broken: %s\n", what.c_str());
    std::abort();
  }
}

std::string u32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
std::string frame(const std::string& body) { return u32(static_cast<uint32_t>(body.size())) + body; }
std::string opening() { return std::string(kMagic, 8) + frame(u32(static_cast<uint32_t>(kToken.size())) + kToken); }

int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  require(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0, "connect to the server");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

void send_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t w = send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL);
    if (w <= 0) return;  // the peer closed: fine, that is its right
    done += static_cast<size_t>(w);
  }
}

// Reads until EOF or `quiet` without data.
void drain(int fd, std::chrono::milliseconds quiet) {
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(quiet.count())) <= 0) return;
    if (recv(fd, buf, sizeof buf, 0) <= 0) return;
  }
}

struct Server {
  std::unique_ptr<TCPStore> store;
  std::unique_ptr<TCPStore> checker;
  Server() {
    TCPStoreOptions o;
    o.is_server = true;
    o.timeout = 5s;
    o.token = kToken;
    store = std::make_unique<TCPStore>("127.0.0.1", 0, o);
    TCPStoreOptions c;
    c.timeout = 5s;
    c.token = kToken;
    checker = std::make_unique<TCPStore>("127.0.0.1", store->port(), c);
  }
};

Server& server() {
  static Server s;
  return s;
}

void server_side(const uint8_t* data, size_t size, bool handshake) {
  Server& s = server();
  int fd = connect_to(s.store->port());
  if (handshake) send_all(fd, opening());
  send_all(fd, std::string(reinterpret_cast<const char*>(data), size));
  shutdown(fd, SHUT_WR);
  drain(fd, 50ms);
  close(fd);
  static int n = 0;
  if (++n % 64 == 0) {  // still serving? (every input would halve the speed)
    s.checker->set("alive", std::string("yes"));
    require(s.checker->get_string("alive") == "yes", "the server stopped serving");
  }
}

// A fake store: a thread that accepts one client per input, completes the
// handshake, reads its request frame and answers with the input's bytes.
struct FakeServer {
  int listen_fd = -1, port = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::string reply;
  bool has_reply = false;
  std::thread thread;

  FakeServer() {
    listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    require(bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && listen(listen_fd, 16) == 0,
            "fake server listen");
    socklen_t len = sizeof a;
    getsockname(listen_fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    thread = std::thread([this] { loop(); });
    thread.detach();
  }

  void loop() {
    for (;;) {
      int c = accept(listen_fd, nullptr, nullptr);
      if (c < 0) continue;
      std::string r;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return has_reply; });
        r = reply;
        has_reply = false;
      }
      // Handshake: magic + token frame in, magic + Ok frame out.
      std::string in;
      char buf[4096];
      auto read_until = [&](size_t n) {
        while (in.size() < n) {
          pollfd p{c, POLLIN, 0};
          if (poll(&p, 1, 2000) <= 0) return false;
          ssize_t got = recv(c, buf, sizeof buf, 0);
          if (got <= 0) return false;
          in.append(buf, static_cast<size_t>(got));
        }
        return true;
      };
      if (read_until(12)) {
        uint32_t tok = 0;
        std::memcpy(&tok, in.data() + 8, 4);
        if (read_until(12 + tok)) {
          in.erase(0, 12 + tok);
          send_all(c, std::string(kMagic, 8) + frame(std::string(1, '\0')));
          if (read_until(4)) {  // the request's length: then answer it
            send_all(c, r);
            shutdown(c, SHUT_WR);
            drain(c, 100ms);
          }
        }
      }
      close(c);
    }
  }
};

FakeServer& fake() {
  static FakeServer f;
  return f;
}

void client_side(const uint8_t* data, size_t size) {
  FakeServer& f = fake();
  {
    std::lock_guard<std::mutex> lock(f.mu);
    f.reply.assign(reinterpret_cast<const char*>(data), size);
    f.has_reply = true;
  }
  f.cv.notify_one();
  TCPStoreOptions o;
  o.timeout = 300ms;
  o.token = kToken;
  try {
    TCPStore client("127.0.0.1", f.port, o);
    client.get("key");
  } catch (const ember::Error&) {
    // Expected for nearly every input: a named error.
  } catch (const std::exception& e) {
    require(false, std::string("the client threw a non-ember exception: ") + e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 1)
    client_side(data + 1, size - 1);
  else
    server_side(data + 1, size - 1, /*handshake=*/data[0] % 4 == 0);
  return 0;
}
