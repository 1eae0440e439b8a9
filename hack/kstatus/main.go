// kstatus evaluates Kubernetes objects the way Flux, kpt and every kstatus-based GitOps
// check do (sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute), so the suite can assert
// what those tools would report for a CompilationCache.
//
// Usage: kubectl get ccache NAME -o json | kstatus
// Reads one object, or a List of them, as JSON on stdin; writes one JSON line per object:
// {"name": ..., "status": "Current|InProgress|Failed|Terminating|Unknown", "message": ...}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Name    string `json:"name"`
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus:", err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer) error {
	data, err := io.ReadAll(in)
	if err != nil {
		return err
	}
	decoded, _, err := unstructured.UnstructuredJSONScheme.Decode(data, nil, nil)
	if err != nil {
		return fmt.Errorf("stdin is not a Kubernetes object or List as JSON: %w", err)
	}
	var objects []unstructured.Unstructured
	switch v := decoded.(type) {
	case *unstructured.UnstructuredList:
		objects = v.Items
	case *unstructured.Unstructured:
		objects = []unstructured.Unstructured{*v}
	default:
		return fmt.Errorf("unexpected object %T", decoded)
	}
	enc := json.NewEncoder(out)
	for i := range objects {
		u := &objects[i]
		res, err := status.Compute(u)
		if err != nil {
			return fmt.Errorf("%s/%s: %w", u.GetNamespace(), u.GetName(), err)
		}
		if err := enc.Encode(result{Name: u.GetName(), Status: res.Status.String(), Message: res.Message}); err != nil {
			return err
		}
	}
	return nil
}
