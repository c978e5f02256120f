{{/*
The labels every object of the install carries: the same as the kustomize install's, so the two
render the same objects (tests/operator/test_operator_cluster_helm.py).
*/}}
{{- define "kvfabric.labels" -}}
app.kubernetes.io/part-of: kvfabric
{{- end }}

{{/* The operator's image reference: repository:tag, or repository@digest when a digest is set. */}}
{{- define "kvfabric.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}
