// pool-probe asks an endpoint picker which endpoint it picks, as a data plane (Envoy's ext_proc
// filter) asks it: one ProcessingRequest with the request's headers per pick, on a stream of its
// own, and the answer's x-gateway-destination-endpoint header. It picks every -every until
// stdin closes (or -count picks are done) and prints one JSON line per pick:
//
//	{"t": 1765100000.123, "endpoint": "127.0.10.4:8080"}
//	{"t": 1765100000.223, "error": "rpc error: code = Internal desc = ... no pods available"}
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

type pick struct {
	T        float64 `json:"t"`
	Endpoint string  `json:"endpoint,omitempty"`
	Error    string  `json:"error,omitempty"`
	Ms       float64 `json:"ms"`
}

func pickOnce(ctx context.Context, client extproc.ExternalProcessorClient, model string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	headers := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: "content-type", RawValue: []byte("application/json")},
	}
	if model != "" {
		headers = append(headers, &corev3.HeaderValue{Key: "x-model-name", RawValue: []byte(model)})
	}
	err = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: headers}, EndOfStream: true}}})
	if err != nil {
		return "", err
	}
	resp, err := stream.Recv()
	if err != nil {
		return "", err
	}
	_ = stream.CloseSend()
	rh := resp.GetRequestHeaders()
	if rh == nil {
		return "", fmt.Errorf("the picker answered %T, not request headers", resp.GetResponse())
	}
	for _, h := range rh.GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == destinationHeader {
			v := string(h.GetHeader().GetRawValue())
			if v == "" {
				v = h.GetHeader().GetValue()
			}
			return v, nil
		}
	}
	return "", fmt.Errorf("no %s header in the picker's answer", destinationHeader)
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the picker's ext_proc gRPC address")
	every := flag.Duration("every", 100*time.Millisecond, "time between picks")
	count := flag.Int("count", 0, "picks to make (0: until stdin closes)")
	model := flag.String("model", "", "x-model-name header to send (optional)")
	useTLS := flag.Bool("tls", true, "TLS to the picker, its certificate unchecked (a picker serves a "+
		"self-signed one by default, and gateways skip its verification as GIE's guides configure them)")
	flag.Parse()

	creds := insecure.NewCredentials()
	if *useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // see -tls
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintln(os.Stderr, "pool-probe:", err)
		os.Exit(2)
	}
	defer conn.Close()
	client := extproc.NewExternalProcessorClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	if *count == 0 {
		go func() { _, _ = io.Copy(io.Discard, os.Stdin); cancel() }()
	}
	out := json.NewEncoder(os.Stdout)
	tick := time.NewTicker(*every)
	defer tick.Stop()
	for n := 0; *count == 0 || n < *count; n++ {
		start := time.Now()
		ep, err := pickOnce(ctx, client, *model)
		p := pick{T: float64(start.UnixNano()) / 1e9, Endpoint: ep, Ms: float64(time.Since(start).Microseconds()) / 1000}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			p.Error = err.Error()
		}
		if err := out.Encode(p); err != nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
