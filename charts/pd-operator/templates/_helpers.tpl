{{- define "pd-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "pd-operator.labels" -}}
app.kubernetes.io/name: pd-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pd-operator.selector" -}}
app.kubernetes.io/name: pd-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pd-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "pd-operator.fullname" .) .Values.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{- /* an image reference: [registry/]repository:tag, from a dict of registry, repository, tag */ -}}
{{- define "pd-operator.imageRef" -}}
{{- with .registry }}{{ trimSuffix "/" . }}/{{ end }}{{ .repository }}:{{ .tag }}
{{- end -}}

{{- /* the operator's image: image.registry (optional), image.repository, image.tag */ -}}
{{- define "pd-operator.image" -}}
{{- include "pd-operator.imageRef" (dict "registry" .Values.image.registry "repository" .Values.image.repository "tag" .Values.image.tag) -}}
{{- end -}}

{{- /* one of the project's other images (name pd-gateway or pd-sim-agent): registry, repository and tag
of its values (v), each defaulting to the operator's (the repository renamed) */ -}}
{{- define "pd-operator.siblingImage" -}}
{{- $v := .v | default dict -}}
{{- $repo := $v.repository | default (printf "%s%s" (trimSuffix "pd-operator" .root.Values.image.repository) .name) -}}
{{- include "pd-operator.imageRef" (dict "registry" ($v.registry | default .root.Values.image.registry) "repository" $repo "tag" ($v.tag | default .root.Values.image.tag)) -}}
{{- end -}}

{{- /* the gateway's image: gateway.image (a whole reference) if set, else gateway.registry,
gateway.repository and gateway.tag, each defaulting to the operator's (repository renamed pd-gateway) */ -}}
{{- define "pd-operator.gatewayImage" -}}
{{- if .Values.gateway.image -}}{{ .Values.gateway.image }}
{{- else -}}{{ include "pd-operator.siblingImage" (dict "root" . "name" "pd-gateway" "v" .Values.gateway) }}{{- end -}}
{{- end -}}

{{- /* the simulator agent's image (engine.image), for the examples this chart prints */ -}}
{{- define "pd-operator.engineImage" -}}
{{- include "pd-operator.siblingImage" (dict "root" . "name" "pd-sim-agent" "v" .Values.engine.image) -}}
{{- end -}}
