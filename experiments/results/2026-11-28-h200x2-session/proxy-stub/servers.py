import json, sys, time, threading
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
arrivals = []
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/dump":
            b = json.dumps(arrivals).encode(); self.send_response(200)
            self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b); return
        self.send_response(200); self.send_header("Content-Length","0"); self.end_headers()
    def do_POST(self):
        t = time.time()
        n = int(self.headers.get("Content-Length", 0)); body = json.loads(self.rfile.read(n))
        rid = self.headers.get("X-Request-Id")
        role = self.server.role
        arrivals.append((role, rid, t))
        if role == "P":
            time.sleep(0.02)
            b = json.dumps({"choices":[{"text":"x"}], "kv_transfer_params": {"remote_engine_id":"e"}}).encode()
            self.send_response(200); self.send_header("Content-Type","application/json")
            self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
        else:
            self.send_response(200); self.send_header("Content-Type","text/event-stream")
            self.send_header("Transfer-Encoding","chunked"); self.end_headers()
            time.sleep(0.03)
            for i in range(16):
                d = ('data: ' + json.dumps({"choices":[{"text":"t","token_ids":[i]}]}) + '\n\n').encode()
                self.wfile.write(f"{len(d):x}\r\n".encode() + d + b"\r\n"); self.wfile.flush(); time.sleep(0.003)
            d=b"data: [DONE]\n\n"; self.wfile.write(f"{len(d):x}\r\n".encode() + d + b"\r\n0\r\n\r\n"); self.wfile.flush()
def serve(port, role):
    s = ThreadingHTTPServer(("127.0.0.1", port), H); s.role = role; s.daemon_threads=True
    threading.Thread(target=s.serve_forever, daemon=True).start()
serve(int(sys.argv[1]), "P"); serve(int(sys.argv[2]), "D")
time.sleep(10**6)
