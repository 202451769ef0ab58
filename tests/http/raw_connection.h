// RawConnection: one plain blocking TCP connection to a loopback server, for
// what the HTTP client cannot express: repeated headers, conflicting framing,
// a body sent in parts, connections held open. One thread per object.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>

namespace loom::testing {

class RawConnection {
 public:
  // Connects to 127.0.0.1:port; ok() is false (and error() the errno) when it can't.
  explicit RawConnection(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) {
      error_ = errno;
      return;
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      error_ = errno;
      Close();
    }
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  ~RawConnection() { Close(); }

  bool ok() const { return fd_ >= 0; }
  int error() const { return error_; }

  bool Send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // One response (head and a Content-Length body); "" when the connection
  // closed or `timeout` passed before it was complete.
  std::string ReadResponse(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const size_t head_end = in_.find("\r\n\r\n");
      if (head_end != std::string::npos) {
        size_t length = 0;
        const size_t cl = Lower(in_.substr(0, head_end)).find("\r\ncontent-length:");
        if (cl != std::string::npos) length = std::strtoul(in_.c_str() + cl + 17, nullptr, 10);
        if (in_.size() >= head_end + 4 + length) {
          std::string response = in_.substr(0, head_end + 4 + length);
          in_.erase(0, response.size());
          return response;
        }
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return "";
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return "";
      in_.append(buf, static_cast<size_t>(n));
    }
  }

  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // The status code of a response ReadResponse() returned; 0 for "".
  static int StatusOf(const std::string& response) {
    return response.rfind("HTTP/1.", 0) == 0 && response.size() > 12 ? std::atoi(response.c_str() + 9) : 0;
  }
  static std::string BodyOf(const std::string& response) {
    const size_t head_end = response.find("\r\n\r\n");
    return head_end == std::string::npos ? "" : response.substr(head_end + 4);
  }

 private:
  static std::string Lower(std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }

  int fd_ = -1;
  int error_ = 0;
  std::string in_;
};

}  // namespace loom::testing
